"""docs/benchmarks.md: what the target's dtype costs on a CPU without bf16 matrix instructions
(bench/target_dtype.py), behind `--dtype auto`."""

from __future__ import annotations

FILES = ["target_dtype_cpu_no-bf16.json"]


def render(results: dict[str, dict]) -> str:
    r = results["target_dtype_cpu_no-bf16.json"]
    s, b, f = r["summary"], r["summary"]["bf16"], r["summary"]["fp32"]
    rounds = len({x["round"] for x in r["runs"]})
    cpu = r["machine"].get("cpu_model", "?")
    return (
        f"- `capture --dtype auto` (and the demo's training) runs the target in bf16, the dtype the engines serve, "
        f"except in-process on a CPU without bf16 matrix instructions, where torch emulates bf16 matmuls and the target "
        f"runs in fp32 instead (the store stays bf16). `eval` keeps bf16 weights: batch-1 decoding reads weights more than it "
        f"multiplies, and bf16's are half the bytes (only its prompt prefills run an fp32 GEMM there, below). On {cpu} ({r['machine'].get('cpu_count')} cores, no AMX / AVX512-BF16; "
        f"SmolLM2, each dtype a fresh process, {rounds} alternating rounds): a prefill of {r['prefill_shape'][0]} × "
        f"{r['prefill_shape'][1]} tokens (a capture batch) runs at {f['prefill_tokens_per_s']:,.0f} tok/s in fp32 vs "
        f"{b['prefill_tokens_per_s']:,.0f} in bf16 (**{s['fp32_over_bf16_prefill']:.1f}x**); a decoding forward of 1 new "
        f"token over a {r['decode_context']}-token cache takes (fp32 vs bf16) {f['decode_1_ms']:.0f} vs {b['decode_1_ms']:.0f} ms, of 4 "
        f"tokens {f['decode_4_ms']:.0f} vs {b['decode_4_ms']:.0f} ms (`bench/results/target_dtype_cpu_no-bf16.json`)."
    )
