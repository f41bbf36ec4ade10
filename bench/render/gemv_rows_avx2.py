"""docs/benchmarks.md: the gemv kernel's AVX2 build vs torch by verified rows (bench/gemv_rows.py on a
CPU without AVX512-BF16)."""

from __future__ import annotations

from _gemv import describe

FILES = ["gemv_rows_cpu_avx2.json"]


def render(results: dict[str, dict]) -> str:
    r = results["gemv_rows_cpu_avx2.json"]
    return (f"- On a CPU without bf16 instructions torch emulates bf16 matmuls, and its cost grows with the rows as the "
            f"kernel's does. {describe(r, 'gemv_rows_cpu_avx2.json', 'The AVX2 build')}.")
