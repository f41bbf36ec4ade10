"""docs/benchmarks.md: the eval's linears in the gemv kernel's AVX2 build vs torch (bench/eval_gemv.py on a
CPU without AVX512-BF16)."""

from __future__ import annotations

from _gemv import measured

FILES = ["eval_gemv_cpu_avx2.json"]


def render(results: dict[str, dict]) -> str:
    r = results["eval_gemv_cpu_avx2.json"]
    return "- The AVX2 build, where torch emulates bf16. " + measured(
        r, "eval_gemv_cpu_avx2.json", "the quick demo's draft, trained on this CPU: a weak draft, so speculative decoding "
        "stays slower than plain decoding here")
