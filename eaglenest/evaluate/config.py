"""`EvalConfig`: the options of `eaglenest eval`, declared once (the CLI is generated from it by
eaglenest/config.py); the engine evaluators' own flags (evaluate/engine_<name>.py) stay flags."""

from __future__ import annotations

from dataclasses import dataclass

from eaglenest.config import option
from eaglenest.evaluate.run import DEFAULT_DTYPE, DTYPES, engine_evaluators


def evaluator_names() -> list[str]:
    return sorted(engine_evaluators())


@dataclass(kw_only=True)
class EvalConfig:
    model: str = option(help="target checkpoint directory or known name (smollm2)")
    draft: str = option(help="exported draft directory (eaglenest export)")
    out: str = option(help="REPORT.json to write (atomically)")
    bench: str = option("mtbench", "'mtbench' (80 questions) or a JSONL file of "
                        "{\"question_id\", \"turns\": [...]} or {\"prompt\": ...} rows")
    limit: int | None = option(None, "only the first N prompts")
    turns: int = option(1, "2: also ask each question's second turn after the model's own first answer", choices=[1, 2])
    steps: int | None = option(None, "draft steps per round (tree depth); default 3, a DFlash draft's block_size - 1 "
                               "(the only value it can be run with)")
    topk: int = option(1, "1 = chain drafting; >1 = tree drafting (top-k per step)")
    num_draft_tokens: int | None = option(None, "tokens verified per round, root included (default steps+1 for topk 1, "
                                          "steps*topk+1 for a tree)")
    temperature: float = option(0.0, "0 = greedy; >0 = speculative rejection sampling")
    draft_sampling: str = option("sample", "at temperature > 0 with --topk 1: sample = draft tokens drawn from the draft's "
                                 "distribution q, accepted with min(1, p/q) (standard speculative sampling; vLLM "
                                 "draft_sample_method=probabilistic); argmax = the draft's argmax proposed and accepted with "
                                 "probability p(token) (SGLang, which supports only this; vLLM's default)",
                                 choices=["sample", "argmax"])
    max_new_tokens: int = option(256, "per generation (each turn)")
    engine: str = option("hf", "which engine decodes", choices=evaluator_names)
    device: str = option("auto", "hf engine: cpu, cuda, cuda:N or auto")
    dtype: str = option(DEFAULT_DTYPE, "target and draft dtype", choices=list(DTYPES))
    attention: str = option("auto", "hf engine: 'rowwise' makes verification forwards bit-identical to plain decoding: each "
                            "verified token's attention is computed as plain decoding computes it, and the Linear shapes a "
                            "set-up probe finds batch-dependent on this machine run row by row (the report's 'verification' "
                            "block says which, and whether the probe passed); 'model' keeps the model's own attention and "
                            "batched linears (faster; exactness only probed and reported); 'auto' = rowwise on a CPU, model "
                            "on a GPU", choices=["auto", "rowwise", "model"])
    linears: str = option("auto", "hf engine, with row-wise attention on a CPU: 'kernel' runs the target's bf16 Linear layers in "
                          "eaglenest's row-invariant matrix-vector kernel (AVX512-BF16, or AVX2 + FMA) for decoding and verification "
                          "forwards (compiled at first use with the system C compiler; faster than torch's, exact by "
                          "construction); 'torch' keeps F.linear (probed per shape); 'auto' = kernel where it can run and the "
                          "verification is chain-sized (its cost grows with the rows: large trees keep torch's GEMM; the "
                          "report's verification.linears says which and why)",
                          choices=["auto", "kernel", "torch"])
    seed: int = option(0, "sampling seed")
    no_baseline: bool = option(False, "skip plain decoding (no speedup, no equivalence check)")
    baseline_limit: int | None = option(None, "run plain decoding (speedup, greedy equivalence) on the first N prompts only")
    workers: int = option(1, "hf engine: decode the conversations in N processes (cores / N threads each); on a CPU, "
                          "batch-1 decoding is latency-bound, so 2 one-thread processes finish sooner than one 2-thread process "
                          "(measured: git show 0c8d13e:bench/results/eval_workers_cpu.json)")
    trust_remote_code: bool = option(False, "allow custom model code")
    engine_arg: list[str] = option(default_factory=list, help="an option for a non-hf engine evaluator (repeatable), "
                                   "passed as args.engine_args", metavar="KEY=VALUE")
