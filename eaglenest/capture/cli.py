"""`eaglenest capture --model TARGET --data DATA_DIR --out FEAT_DIR [--engine hf|vllm|sglang]`: options are
CaptureConfig's fields (eaglenest/capture/config.py); the engines' flags are added by eaglenest/engines."""

from __future__ import annotations

import argparse

from eaglenest.config import add_command


def register(sub) -> None:
    from eaglenest.capture.config import CaptureConfig
    from eaglenest.engines import add_engine_arguments

    p = add_command(
        sub, CaptureConfig, _run,
        "capture",
        help="run the target on prepared ids and store its hidden states (EAGLE-3 / DFlash features)",
        description="Run the target on exactly the prepared token ids and keep its hidden states at the aux layers "
        "(capture-before ids: id k = HF hidden_states[k]; default EAGLE-3's three, [2, N//2, N-3]; --layers takes any "
        "number, e.g. five for DFlash) plus the final state, in a "
        "checksummed, resumable feature store. Re-running the same command resumes: stored samples are skipped. "
        "--dry-run reads only the target's config.json (no weights) and prints bytes per token and the total "
        "size in every store dtype beside the free disk. Options can come from a YAML file (--config; flags win; "
        "engine flags only as flags).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_engine_arguments(p)


def _run(cfg, args) -> int:
    import sys
    from pathlib import Path

    import torch

    from eaglenest import EaglenestError
    from eaglenest.capture.layers import parse_layer_ids
    from eaglenest.capture.run import _done_ids, check_room, print_plan, resolve_store_dtype, run_capture
    from eaglenest.features.store import describe_scheme, fp8_block_for, is_fp8
    from eaglenest.data import PreparedData
    from eaglenest.engines import get_engine_module
    from eaglenest.models.target import model_config, resolve_model_path
    from eaglenest.utils import auto_dtype

    out = Path(cfg.out)
    path = resolve_model_path(cfg.model)
    target = model_config(path)  # config.json only: the plan and the disk check come before any weight is loaded
    try:
        hidden, n_layers = int(target["hidden_size"]), int(target["num_hidden_layers"])
    except (KeyError, TypeError, ValueError):
        raise EaglenestError(f"{path}/config.json: no integer hidden_size / num_hidden_layers (nor in text_config)") from None
    layer_ids = parse_layer_ids(cfg.layers, n_layers)  # the plan's size depends on how many
    # auto asks for bf16's precision (fp32 only where bf16 is slow here): the store and the states follow it
    precision = "bf16" if cfg.dtype == "auto" else cfg.dtype
    run_dtype, dtype_why = auto_dtype(cfg.dtype, getattr(args, "device", "auto"), cfg.engine)
    store_dtype, why = resolve_store_dtype(cfg.store_dtype, precision, hidden)
    if run_dtype != precision:  # fp32 for speed only: hand on bf16 states, as a bf16 run would
        args.states_dtype = torch.bfloat16
    cfg.dtype = args.dtype = run_dtype  # the engine reads args
    block = fp8_block_for(hidden, cfg.fp8_block) if is_fp8(store_dtype) else None
    print(f"capture: target runs in {run_dtype} ({dtype_why}); store dtype {describe_scheme(store_dtype, block, hidden)} ({why})",
          file=sys.stderr)
    if cfg.data is None and not (cfg.dry_run and cfg.tokens is not None):
        raise EaglenestError("capture needs --data (only `--dry-run --tokens N` plans without data)")
    if cfg.data is None:
        n_samples, todo, n_done = None, cfg.tokens, 0
    else:
        data = PreparedData(cfg.data)
        done = _done_ids(out)
        n = len(data) if cfg.limit is None else min(cfg.limit, len(data))
        lengths = {data[i].id: len(data[i].input_ids) for i in range(n)}
        n_samples = sum(1 for sid in lengths if sid not in done)
        todo = sum(t for sid, t in lengths.items() if sid not in done)
        n_done = n - n_samples
    if cfg.dry_run:
        fits = print_plan(out, str(path), hidden, n_layers, n_samples, todo, n_done, store_dtype, cfg.dtype, layer_ids, fp8_block=block)
        return 0 if fits or cfg.ignore_disk else 1
    check_room(out, todo, hidden, store_dtype, cfg.ignore_disk, fp8_block=block, aux_layers=len(layer_ids))
    engine = get_engine_module(cfg.engine).create(args)  # engines read their flags from args
    with engine:
        s = run_capture(
            engine,
            data,
            out,
            dtype=store_dtype,
            fp8_block=cfg.fp8_block,
            batch_tokens=cfg.batch_tokens,
            ignore_disk=cfg.ignore_disk,
            max_failures=cfg.max_failures,
            limit=cfg.limit,
        )
    return 0 if s.failed == 0 else 1
