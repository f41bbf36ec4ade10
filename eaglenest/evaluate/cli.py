"""`eaglenest eval --model TARGET --draft DRAFT_DIR --out REPORT.json`."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    from eaglenest.evaluate.run import DEFAULT_DTYPE, DTYPES, engine_evaluators

    p = sub.add_parser(
        "eval",
        help="measure acceptance length (tau) and speedup of a draft",
        description="Speculative decoding with an EAGLE-3 draft over the target, batch size 1: reports tau "
        "(tokens per target verification step, bonus included; an always-wrong draft gives 1.0), the "
        "acceptance rate per draft position, tokens/s against plain decoding of the same target in the same "
        "dtype, and (at temperature 0) whether the outputs are token-identical to plain greedy decoding.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", required=True, help="target checkpoint directory or known name (smollm2)")
    p.add_argument("--draft", required=True, help="exported draft directory (eaglenest export)")
    p.add_argument("--out", required=True, help="REPORT.json to write (atomically)")
    p.add_argument("--bench", default="mtbench", help="'mtbench' (80 questions) or a JSONL file of "
                   "{\"question_id\", \"turns\": [...]} or {\"prompt\": ...} rows")
    p.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    p.add_argument("--turns", type=int, default=1, choices=[1, 2],
                   help="2: also ask each question's second turn after the model's own first answer")
    p.add_argument("--steps", type=int, default=3, help="draft steps per round (tree depth)")
    p.add_argument("--topk", type=int, default=1, help="1 = chain drafting; >1 = tree drafting (top-k per step)")
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help="tokens verified per round, root included (default steps+1 for topk 1, steps*topk+1 for a tree)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; >0 = speculative rejection sampling")
    p.add_argument("--max-new-tokens", type=int, default=256, help="per generation (each turn)")
    p.add_argument("--engine", default="hf", choices=sorted(engine_evaluators()), help="which engine decodes")
    p.add_argument("--device", default="auto", help="hf engine: cpu, cuda, cuda:N or auto")
    p.add_argument("--dtype", default=DEFAULT_DTYPE, choices=list(DTYPES), help="target and draft dtype")
    p.add_argument("--attention", default="auto", choices=["auto", "rowwise", "model"],
                   help="hf engine: 'rowwise' makes verification forwards bit-identical to plain decoding: each "
                   "verified token's attention is computed as plain decoding computes it, and the Linear shapes a "
                   "set-up probe finds batch-dependent on this machine run row by row (the report's 'verification' "
                   "block says which, and whether the probe passed); 'model' keeps the model's own attention and "
                   "batched linears (faster; exactness only probed and reported); 'auto' = rowwise on a CPU, model "
                   "on a GPU")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--no-baseline", action="store_true", help="skip plain decoding (no speedup, no equivalence check)")
    p.add_argument("--baseline-limit", type=int, default=None,
                   help="run plain decoding (speedup, greedy equivalence) on the first N prompts only")
    p.add_argument("--workers", type=int, default=1,
                   help="hf engine: decode the conversations in N processes (cores / N threads each); on a CPU, "
                   "batch-1 decoding is latency-bound and 2 one-thread processes decode ~1.35x the tokens/s of one")
    p.add_argument("--trust-remote-code", action="store_true", help="allow custom model code")
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="an option for a non-hf engine evaluator (repeatable), passed as args.engine_args")
    _add_evaluator_arguments(p)
    p.set_defaults(func=_run)


def _add_evaluator_arguments(p) -> None:
    """The flags an engine evaluator module (`evaluate/engine_<name>.py`) declares with `add_arguments`
    (those modules import nothing heavy at module level)."""
    import importlib
    import pkgutil
    from pathlib import Path

    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if info.name.startswith("engine_"):
            mod = importlib.import_module(f"{__package__}.{info.name}")
            if hasattr(mod, "add_arguments"):
                mod.add_arguments(p.add_argument_group(f"{info.name[len('engine_'):]} evaluator"))


def _run(args) -> int:
    from eaglenest import EaglenestError
    from eaglenest.evaluate.run import main_eval

    engine_args = {}
    for kv in args.engine_arg:
        if "=" not in kv:
            raise EaglenestError(f"--engine-arg wants KEY=VALUE (got {kv!r})")
        k, v = kv.split("=", 1)
        engine_args[k.strip()] = v
    args.engine_args = engine_args
    return main_eval(args)
