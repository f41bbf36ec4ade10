"""`eaglenest capture --model TARGET --data DATA_DIR --out FEAT_DIR [--engine hf|vllm|sglang]`."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    from eaglenest.engines import add_engine_arguments, engine_modules

    engines = engine_modules()
    p = sub.add_parser(
        "capture",
        help="run the target on prepared ids and store EAGLE-3 features",
        description="Run the target on exactly the prepared token ids and keep its hidden states at three aux layers "
        "(capture-before ids: id k = HF hidden_states[k]; default [2, N//2, N-3]) plus the final state, in a "
        "checksummed, resumable feature store. Re-running the same command resumes: stored samples are skipped.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", required=True, help="target checkpoint directory or known name (smollm2)")
    p.add_argument("--data", required=True, help="DATA_DIR written by `eaglenest prepare`")
    p.add_argument("--out", required=True, help="feature store directory (created or resumed)")
    p.add_argument("--engine", default="hf", choices=sorted(engines), help="which engine runs the target")
    p.add_argument("--layers", default="auto", help="aux layer ids, capture-before convention: auto or i,j,k")
    p.add_argument("--batch-tokens", type=int, default=8192, help="max padded tokens per batch")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="model and stored-feature dtype")
    p.add_argument("--limit", type=int, default=None, help="only the first N prepared samples")
    p.add_argument("--dry-run", action="store_true", help="print tokens to process and disk needed, then stop")
    p.add_argument("--ignore-disk", action="store_true", help="start even if the disk estimate exceeds free space")
    p.add_argument("--max-failures", type=int, default=None, help="stop once more samples than this have failed")
    add_engine_arguments(p, engines)
    p.set_defaults(func=_run)


def _run(args) -> int:
    from pathlib import Path

    from eaglenest.capture.run import run_capture
    from eaglenest.data import PreparedData
    from eaglenest.engines import get_engine_module

    data = PreparedData(args.data)
    engine = get_engine_module(args.engine).create(args)
    with engine:
        s = run_capture(
            engine,
            data,
            Path(args.out),
            dtype=args.dtype,
            batch_tokens=args.batch_tokens,
            dry_run=args.dry_run,
            ignore_disk=args.ignore_disk,
            max_failures=args.max_failures,
            limit=args.limit,
        )
    return 0 if s.failed == 0 else 1
