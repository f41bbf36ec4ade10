"""`CaptureConfig`: the options of `eaglenest capture`, declared once (the CLI is generated from it
by eaglenest/config.py); the engines' own flags stay flags (eaglenest/engines)."""

from __future__ import annotations

from dataclasses import dataclass

from eaglenest.capture.run import COMPACT_DTYPE, COMPACT_FROM_HIDDEN
from eaglenest.config import option
from eaglenest.engines import engine_names
from eaglenest.features.store import FP8_BLOCK, STORE_DTYPES


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
    dtype: str = option("auto", "dtype the target runs in: auto = bf16, except for the hf engine on a CPU without bf16 "
                        "matrix instructions (AVX2-only), where fp32 runs several times faster (its store stays bf16); "
                        "an explicit fp32 run keeps an fp32 store under --store-dtype auto",
                        choices=["auto", "bf16", "fp32"])
    store_dtype: str = option("auto", f"how the states are stored: fp8 = float8 e4m3 with a power-of-two scale per "
                              f"--fp8-block values (half of bf16's bytes; decoded to bf16 on read), fp8-aux = only the aux "
                              f"states in fp8; auto (the default) = {COMPACT_DTYPE} for a target with hidden size >= "
                              f"{COMPACT_FROM_HIDDEN} run in bf16, else --dtype (so --dtype fp32 stores fp32). The resolved "
                              f"choice is printed at start; the measured cost is in docs/benchmarks.md", choices=["auto", *STORE_DTYPES])
    fp8_block: int = option(FP8_BLOCK, "fp8 stores: how many consecutive values of a layer share one scale (the largest "
                            "divisor of the hidden size <= N is used; 0 = one scale per token and layer, the scheme of fp8 "
                            f"stores written before this option, which loses the small channels of targets with massive "
                            f"activations) (default: {FP8_BLOCK})", metavar="N")
    limit: int | None = option(None, "only the first N prepared samples")
    dry_run: bool = option(False, "print tokens, bytes per token and disk needed per store dtype, then stop "
                           "(exit 1 if the chosen store dtype does not fit)")
    tokens: int | None = option(None, "--dry-run without --data: plan for this many tokens")
    ignore_disk: bool = option(False, "start even if the disk estimate exceeds free space")
    max_failures: int | None = option(None, "stop once more samples than this have failed")
