"""README *On a CPU*: the gemv kernel vs torch by verified rows (bench/gemv_rows.py)."""

from __future__ import annotations

from _gemv import describe

FILES = ["gemv_rows_cpu.json"]


def render(results: dict[str, dict]) -> str:
    r = results["gemv_rows_cpu.json"]
    return (
        f"- The kernel's work grows with the rows it computes, torch's batched GEMM's hardly at these sizes (where the "
        f"CPU has bf16 matrix instructions). {describe(r, 'gemv_rows_cpu.json', 'Its AVX512-BF16 build')} (every chain "
        f"the demo and the defaults verify); larger trees keep torch's kernels (probed, row by row where batch-dependent), "
        f"or `--linears kernel` forces it."
    )
