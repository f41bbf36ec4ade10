"""docs/benchmarks.md: the eval's linears in eaglenest's gemv kernel vs torch (bench/eval_gemv.py)."""

from __future__ import annotations

from _gemv import measured

FILES = ["eval_gemv_cpu.json"]


def render(results: dict[str, dict]) -> str:
    r = results["eval_gemv_cpu.json"]
    return (
        f"- `eval --linears kernel` (`auto` picks it on an x86-64 CPU with AVX512-BF16, or else AVX2 + FMA, and a C "
        f"compiler) computes the bf16 Linear layers of decoding and verification forwards in eaglenest's own "
        f"matrix-vector kernel (`eaglenest/native/gemv.py`, one source built for either instruction set): each output "
        f"is one fixed sequence of instructions, so a k-row verification row is bit-identical to a one-row decode by "
        f"construction, and it streams the weights faster than torch's bf16 `F.linear` does for one row. "
        + measured(r, "eval_gemv_cpu.json", "the full demo's draft")
    )
