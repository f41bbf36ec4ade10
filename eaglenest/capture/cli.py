"""`eaglenest capture --model TARGET --data DATA_DIR --out FEAT_DIR [--engine hf|vllm|sglang]`."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    from eaglenest.capture.run import COMPACT_DTYPE, COMPACT_FROM_HIDDEN
    from eaglenest.engines import add_engine_arguments, engine_modules
    from eaglenest.features.store import STORE_DTYPES

    engines = engine_modules()
    p = sub.add_parser(
        "capture",
        help="run the target on prepared ids and store EAGLE-3 features",
        description="Run the target on exactly the prepared token ids and keep its hidden states at three aux layers "
        "(capture-before ids: id k = HF hidden_states[k]; default [2, N//2, N-3]) plus the final state, in a "
        "checksummed, resumable feature store. Re-running the same command resumes: stored samples are skipped. "
        "--dry-run reads only the target's config.json (no weights) and prints bytes per token and the total "
        "size in every store dtype beside the free disk.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", required=True, help="target checkpoint directory or known name (smollm2)")
    p.add_argument("--data", default=None, help="DATA_DIR written by `eaglenest prepare` (required unless --dry-run --tokens)")
    p.add_argument("--out", required=True, help="feature store directory (created or resumed)")
    p.add_argument("--engine", default="hf", choices=sorted(engines), help="which engine runs the target")
    p.add_argument("--layers", default="auto", help="aux layer ids, capture-before convention: auto or i,j,k")
    p.add_argument("--batch-tokens", type=int, default=8192, help="max padded tokens per batch")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="dtype the target runs in")
    p.add_argument(
        "--store-dtype",
        default="auto",
        choices=["auto", *STORE_DTYPES],
        help=f"how the states are stored: fp8 = float8 e4m3 with a power-of-two scale per token and per layer (half "
        f"of bf16's bytes; decoded to bf16 on read), fp8-aux = only the aux states in fp8; auto = {COMPACT_DTYPE} for "
        f"targets with hidden size >= {COMPACT_FROM_HIDDEN}, else --dtype (the measured cost is in the README)",
    )
    p.add_argument("--limit", type=int, default=None, help="only the first N prepared samples")
    p.add_argument("--dry-run", action="store_true", help="print tokens, bytes per token and disk needed per store dtype, then stop "
                   "(exit 1 if the chosen store dtype does not fit)")
    p.add_argument("--tokens", type=int, default=None, help="--dry-run without --data: plan for this many tokens")
    p.add_argument("--ignore-disk", action="store_true", help="start even if the disk estimate exceeds free space")
    p.add_argument("--max-failures", type=int, default=None, help="stop once more samples than this have failed")
    add_engine_arguments(p, engines)
    p.set_defaults(func=_run)


def _run(args) -> int:
    from pathlib import Path

    from eaglenest import EaglenestError
    from eaglenest.capture.run import _done_ids, check_room, print_plan, resolve_store_dtype, run_capture
    from eaglenest.data import PreparedData
    from eaglenest.engines import get_engine_module
    from eaglenest.models.target import model_config, resolve_model_path

    out = Path(args.out)
    path = resolve_model_path(args.model)
    cfg = model_config(path)  # config.json only: the plan and the disk check come before any weight is loaded
    try:
        hidden, n_layers = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    except (KeyError, TypeError, ValueError):
        raise EaglenestError(f"{path}/config.json: no integer hidden_size / num_hidden_layers (nor in text_config)") from None
    store_dtype = resolve_store_dtype(args.store_dtype, args.dtype, hidden)
    if args.data is None and not (args.dry_run and args.tokens is not None):
        raise EaglenestError("capture needs --data (only `--dry-run --tokens N` plans without data)")
    if args.data is None:
        n_samples, todo, n_done = None, args.tokens, 0
    else:
        data = PreparedData(args.data)
        done = _done_ids(out)
        n = len(data) if args.limit is None else min(args.limit, len(data))
        lengths = {data[i].id: len(data[i].input_ids) for i in range(n)}
        n_samples = sum(1 for sid in lengths if sid not in done)
        todo = sum(t for sid, t in lengths.items() if sid not in done)
        n_done = n - n_samples
    if args.dry_run:
        fits = print_plan(out, str(path), hidden, n_layers, n_samples, todo, n_done, store_dtype, args.dtype)
        return 0 if fits or args.ignore_disk else 1
    check_room(out, todo, hidden, store_dtype, args.ignore_disk)
    engine = get_engine_module(args.engine).create(args)
    with engine:
        s = run_capture(
            engine,
            data,
            out,
            dtype=store_dtype,
            batch_tokens=args.batch_tokens,
            ignore_disk=args.ignore_disk,
            max_failures=args.max_failures,
            limit=args.limit,
        )
    return 0 if s.failed == 0 else 1
