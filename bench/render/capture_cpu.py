"""docs/benchmarks.md: what capture costs over a plain forward of the target on a CPU (bench/capture_cpu.py)."""

from __future__ import annotations

from _fmt import cpu, num

FILES = ["capture_cpu.json"]


def render(results: dict[str, dict]) -> str:
    r = results["capture_cpu.json"]
    return (f"Capture vs a plain forward of the target (SmolLM2, {r['dtype']}, {r['samples']} ShareGPT samples, {cpu(r)}; "
            f"`bench/results/capture_cpu.json`): {num(r['capture_tokens_per_s'])} vs {num(r['plain_forward_tokens_per_s'])} "
            f"tok/s (**{r['ratio']:.2f}x**), {num(r['bytes_per_token'])} bytes per token stored.")
