"""`CaptureConfig`: the options of `eaglenest capture`, declared once (the CLI is generated from it
by eaglenest/config.py); the engines' own flags stay flags (eaglenest/engines)."""

from __future__ import annotations

from dataclasses import dataclass

from eaglenest.capture.run import COMPACT_DTYPE, COMPACT_FROM_HIDDEN
from eaglenest.config import option
from eaglenest.engines import engine_names
from eaglenest.features.store import STORE_DTYPES


@dataclass(kw_only=True)
class CaptureConfig:
    model: str = option(help="target checkpoint directory or known name (smollm2)")
    data: str | None = option(None, "DATA_DIR written by `eaglenest prepare` (required unless --dry-run --tokens)")
    out: str = option(help="feature store directory (created or resumed)")
    engine: str = option("hf", "which engine runs the target", choices=engine_names)
    layers: str = option("auto", "aux layer ids, capture-before convention: auto (EAGLE-3's [2, N//2, N-3]), dflash "
                         "(DFlash's default: five spread over the depth, [2, 9, 15, 21, 28] for 30 layers) or any "
                         "number of increasing ids i,j,k,...")
    batch_tokens: int = option(8192, "max padded tokens per batch")
    dtype: str = option("bf16", "dtype the target runs in", choices=["bf16", "fp32"])
    store_dtype: str = option("auto", f"how the states are stored: fp8 = float8 e4m3 with a power-of-two scale per token and "
                              f"per layer (half of bf16's bytes; decoded to bf16 on read), fp8-aux = only the aux states in "
                              f"fp8; auto = {COMPACT_DTYPE} for targets with hidden size >= {COMPACT_FROM_HIDDEN}, else --dtype "
                              f"(the measured cost is in the README)", choices=["auto", *STORE_DTYPES])
    limit: int | None = option(None, "only the first N prepared samples")
    dry_run: bool = option(False, "print tokens, bytes per token and disk needed per store dtype, then stop "
                           "(exit 1 if the chosen store dtype does not fit)")
    tokens: int | None = option(None, "--dry-run without --data: plan for this many tokens")
    ignore_disk: bool = option(False, "start even if the disk estimate exceeds free space")
    max_failures: int | None = option(None, "stop once more samples than this have failed")
