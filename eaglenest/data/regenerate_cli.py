"""`eaglenest regenerate --model TARGET --data DATA_DIR --out DATA_DIR2 [--engine vllm|hf]`."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    from eaglenest.engines import add_engine_arguments, engine_modules

    engines = {n: m for n, m in engine_modules().items()}
    p = sub.add_parser(
        "regenerate",
        help="replace assistant turns with the target's own answers",
        description="The EAGLE-3 recipe: rebuild every prepared sample with the target's own answers. For each assistant "
        "turn (a run of the loss mask), the target continues the conversation as it stands -- the original system/user "
        "tokens and its own earlier answers -- and its answer (ending with the end-of-turn token) replaces the data "
        "set's, with the loss mask over exactly the generated tokens. A turn cut by the length limit ends the sample "
        "there (later turns dropped, counted as truncated). Token-exact (echoed prompt ids are checked) and resumable: "
        "re-run the same command to continue; OUT becomes an ordinary DATA_DIR for `eaglenest capture`.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", required=True, help="target checkpoint directory or known name (smollm2)")
    p.add_argument("--data", required=True, help="DATA_DIR written by `eaglenest prepare`")
    p.add_argument("--out", required=True, help="output DATA_DIR (created, or resumed)")
    p.add_argument("--engine", default="vllm" if "vllm" in engines else "hf", choices=sorted(engines), help="which engine generates")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (0 = greedy)")
    p.add_argument("--max-new-tokens", type=int, default=512, help="max tokens generated per assistant turn")
    p.add_argument("--max-turns", type=int, default=None, help="keep only the first N assistant turns of each sample (default: all)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--batch-size", type=int, default=32, help="samples regenerated (and checkpointed) together")
    p.add_argument("--limit", type=int, default=None, help="only the first N prepared samples")
    p.add_argument("--max-failures", type=int, default=None, help="stop once more samples than this have failed")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="model dtype")
    p.add_argument("--layers", default="auto", help=argparse.SUPPRESS)
    add_engine_arguments(p, engines)
    p.set_defaults(func=_run)


def _run(args) -> int:
    from eaglenest import EaglenestError
    from eaglenest.data import PreparedData
    from eaglenest.data.regenerate import run_regenerate
    from eaglenest.engines import get_engine_module
    from eaglenest.models.target import resolve_model_path

    if args.max_new_tokens < 1:
        raise EaglenestError("--max-new-tokens must be at least 1")
    if args.temperature < 0:
        raise EaglenestError("--temperature must be >= 0")
    data = PreparedData(args.data)
    model_path = resolve_model_path(args.model)
    engine = get_engine_module(args.engine).create(args)
    with engine:
        s = run_regenerate(
            engine,
            data,
            args.out,
            model_path=model_path,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            seed=args.seed,
            max_turns=args.max_turns,
            batch_size=args.batch_size,
            limit=args.limit,
            max_failures=args.max_failures,
        )
    return 0 if s.failed == 0 else 1
