"""docs/benchmarks.md: bytes per token of each store dtype (bench/store_dtype.py)."""

from __future__ import annotations

from _fmt import num

FILES = ["store_dtype.json"]
SEED_TOKENS = 17_300_000  # the seed's job: Kimi-K2.5 features for 17.3M tokens
KEPT = {
    "bf16": ("bf16", "aux + final state in bf16"),
    "fp8": ("**fp8**", "aux + final state in e4m3"),
    "fp8-aux": ("fp8-aux", "aux in e4m3, final state (it feeds the teacher's logits) bf16"),
}


def render(results: dict[str, dict]) -> str:
    r = results["store_dtype.json"]
    V, kimi = r["variants"], r["bytes_per_token_kimi_k25_shape"]
    base = V["bf16"]
    lines = [f"| store dtype | kept | bytes/token SmolLM2 (H 576; on disk, {base['samples']} samples, {num(base['tokens'])} tokens) "
             f"| bytes/token Kimi-K2.5 shape (H 7168; GiB for {SEED_TOKENS / 1e6:.1f}M tokens) |", "|---|---|---|---|"]
    for v, (name, kept) in KEPT.items():
        x = V[v]
        smol = x["bytes_on_disk_per_token"]
        rel = "" if v == "bf16" else f" ({smol / base['bytes_on_disk_per_token']:.2f}x)"
        k = kimi[v]
        krel = "" if v == "bf16" else f"{k / kimi['bf16']:.2f}x, "
        lines.append(f"| {name} | {kept} | {num(smol)}{rel} | {num(k)} ({krel}{k * SEED_TOKENS / 2**30:,.0f} GiB) |")
    return "\n".join(lines)
