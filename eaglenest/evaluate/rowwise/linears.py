"""Linear layers for exact verification: row by row, or in eaglenest's gemv kernel.

set_rowwise: torch's F.linear on one row at a time (the M=1 call plain decoding makes) in forwards of
2..max_rows rows, for the weight shapes whose batched kernel the probe found row-dependent.
install_gemv / set_kernel: every bf16 CPU Linear in the gemv kernel (native/gemv.py) for forwards of
1..max_rows rows, plain decoding included, so both decoders run one per-row arithmetic by
construction.  Longer forwards (prompt prefills, which plain and speculative decoding share, so
either GEMM keeps verification exact) run in the GEMM `prefill_gemm` picks.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from eaglenest.evaluate.rowwise import each_row, rows, set_forward
from eaglenest.native import gemv

LINEAR_CHOICES = ("auto", "kernel", "torch")
# `--linears auto` takes the gemv kernel for verifications of at most this many rows, per CPU kind
# (utils.cpu_kind): where it stops beating torch's batched kernels, which on AMX run on its tiles
# (the retired probe gemv_rows: git show afe579c:bench/results/gemv_rows_cpu_<kind>.json; amx's from a dirty tree:
# git show 8881492:bench/results/gemv_rows_cpu.json)
GEMV_AUTO_MAX_ROWS = {"amx": 8, "avx512-bf16": 16, "avx2": 64}


def auto_max_rows() -> int:
    """The most verified rows `--linears auto` gives the kernel on this CPU."""
    from eaglenest.utils import cpu_kind

    return GEMV_AUTO_MAX_ROWS[cpu_kind()]


def _linear_by_rows(module: torch.nn.Linear, max_rows: int, x: torch.Tensor) -> torch.Tensor:
    if not 1 < rows(x) <= max_rows:  # plain decoding (already one row) and long prefills
        return F.linear(x, module.weight, module.bias)
    return each_row(lambda r: F.linear(r, module.weight, module.bias), x)


def _linear_by_kernel(module: torch.nn.Linear, max_rows: int, x: torch.Tensor, fp32_prefill: bool = False) -> torch.Tensor:
    if 1 <= rows(x) <= max_rows and x.dtype == torch.bfloat16:
        return gemv.linear(x, module.weight, module.bias)
    if fp32_prefill and x.dtype == torch.bfloat16:
        # a long prefill where torch emulates bf16 GEMMs (no AMX / AVX512-BF16): the same bf16 values in an
        # fp32 GEMM, rounded back: faster there (the demo's eval: git show 0c8d13e:bench/results/eval_prefill_cpu_avx2.json)
        b = None if module.bias is None else module.bias.float()
        return F.linear(x.float(), module.weight.float(), b).to(x.dtype)
    return F.linear(x, module.weight, module.bias)  # long prefills: the GEMM, shared by both decoders


def set_rowwise(module: torch.nn.Linear, max_rows: int | None) -> None:
    """Compute `module` one row at a time in forwards of 2..max_rows rows (None: batched again)."""
    set_forward(module, _linear_by_rows, max_rows)


def set_kernel(module: torch.nn.Linear, max_rows: int | None, fp32_prefill: bool = False) -> None:
    """Compute `module` in the gemv kernel in forwards of 1..max_rows rows (None: F.linear again);
    longer forwards (prefills) in an fp32 GEMM with `fp32_prefill`, else in F.linear."""
    set_forward(module, functools.partial(_linear_by_kernel, fp32_prefill=fp32_prefill), max_rows)


def install_gemv(model, max_rows: int, linears: str) -> dict:
    """Put the model's bf16 CPU Linears on the row-invariant gemv kernel (native/gemv.py) for
    forwards of 1..max_rows rows -- plain decoding and verification then run the same per-row
    arithmetic -- where `linears` asks for it ('auto': where it can run, for verifications of at most
    auto_max_rows() rows on this CPU; 'kernel': required; 'torch': never).
    Returns the report's `linears` block."""
    from eaglenest import EaglenestError

    if linears not in LINEAR_CHOICES:
        raise EaglenestError(f"--linears must be one of {', '.join(LINEAR_CHOICES)} (got {linears!r})")
    mods = [m for m in model.modules() if isinstance(m, torch.nn.Linear)
            and m.weight.dtype == torch.bfloat16 and m.weight.device.type == "cpu"]
    isa = gemv.isa()
    if linears == "torch":
        why = "--linears torch"
    elif not mods:
        why = "no bf16 CPU Linear layers"
    else:
        why = gemv.load()[1]
        if not why and linears == "auto" and max_rows > (limit := auto_max_rows()):
            why = (f"verification of {max_rows} rows: above {limit} the kernel's work grows with the rows and torch's "
                   f"batched kernels are faster here (docs/cpu.md); --linears kernel forces it")
    if why:
        if linears == "kernel":
            raise EaglenestError(f"--linears kernel: the gemv kernel cannot run here ({why})")
        return {"kernel": "torch", "why": why}
    fp32_prefill, prefill = prefill_gemm()
    for m in mods:
        set_kernel(m, max_rows, fp32_prefill)
    return {"kernel": "eaglenest-gemv", "isa": isa, "modules": len(mods), "max_rows": max_rows,
            "why": f"row-invariant by construction (each output one fixed sequence of {isa} instructions) "
                   "and faster than torch's bf16 matrix-vector products on a CPU",
            "prefill": prefill}


def prefill_gemm() -> tuple[bool, str]:
    """(fp32?, why) for the Linears of forwards longer than a verification (prompt prefills, which
    plain and speculative decoding share, so either choice keeps verification exact): fp32 where
    the CPU has no bf16 matrix instructions, as capture's `--dtype auto` decides (utils.auto_dtype).
    EAGLENEST_BF16_PREFILL=1 keeps torch's bf16 GEMM (the other arm of bench/eval_prefill.py)."""
    from eaglenest.utils import cpu_has_fast_bf16

    if cpu_has_fast_bf16():
        return False, "torch's bf16 GEMM (this CPU has bf16 matrix instructions)"
    if os.environ.get("EAGLENEST_BF16_PREFILL") == "1":
        return False, "torch's bf16 GEMM (EAGLENEST_BF16_PREFILL=1)"
    return True, ("the bf16 values in an fp32 GEMM, rounded to bf16: this CPU has no bf16 matrix instructions, "
                  "where torch emulates bf16 GEMMs several times slower")
