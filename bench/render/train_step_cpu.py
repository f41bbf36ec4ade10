"""docs/benchmarks.md: the training step with the chunked vs the eager attention on a CPU (bench/train_step.py)."""

from __future__ import annotations

from _fmt import cpu

FILES = ["train_step_cpu_smollm2_512.json", "train_step_cpu_smollm2_1024.json", "train_step_cpu_smollm2_2048.json"]


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def render(results: dict[str, dict]) -> str:
    rs = [results[f] for f in FILES]
    r = rs[0]
    rows = [f"| {x['seq']:,} | {x['ours']['tokens_per_s']:.1f} | {x['ours_eager']['tokens_per_s']:.1f} | "
            f"{x['ours']['peak_gib']:.2f} | {x['ours_eager']['peak_gib']:.2f} | "
            f"{_rel(x['ours_detail']['losses'], x['ours_eager_detail']['losses']):.1e} |" for x in rs]
    return "\n".join([
        f"One training step of a SmolLM2-shaped draft (TTT {r['ttt']}, draft vocabulary {r['shape_dims']['Vd']:,}) on "
        f"{cpu(r)}, {r['torch_threads']} thread, median of {r['steps']} steps: the chunked attention vs the eager reference "
        f"(`bench/results/train_step_cpu_smollm2_*.json`; peak = the process's max RSS):", "",
        "| tokens | chunked tok/s | eager tok/s | chunked peak GiB | eager peak GiB | losses, largest relative difference |",
        "|---:|---:|---:|---:|---:|---|", *rows])
