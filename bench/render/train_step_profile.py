"""docs/benchmarks.md: where the CPU training step's time goes, base vs new (bench/train_step.py
profile), one row per recipe, CPU kind and arm."""

from __future__ import annotations

from _fmt import cpu

FILES = ["train_step_profile_*_*.json"]
CATS = ("GEMM", "attention", "loss", "elementwise", "optimizer")


def row(r: dict, name: str) -> str:
    a = r["arms"][name]
    s = a["seconds_per_step"]
    busy = sum(s.values())
    return (f"| {r['cpu_kind']} | {r['recipe']} | {name} ({a['commit'][:7]}) | **{a['gemm_gflop_per_step']:.0f}** | "
            f"{a['gemm_gflop_per_s']:.0f} | " + " | ".join(f"{s.get(c, 0.0):.2f}" for c in CATS) + f" | {busy:.2f} |")


def render(results: dict[str, dict]) -> str:
    rs = sorted(results.values(), key=lambda x: (x["recipe"], x["cpu_kind"]))
    r = rs[0]
    machines = ", ".join(dict.fromkeys(f"{cpu(x)} ({x['cpu_kind']})" for x in rs))
    return "\n".join([
        f"Where a step's time goes, the same arms and recipes as above: one run of each arm, {r['profiled_steps']} "
        f"optimizer steps under torch.profiler after {r['after_steps']} warm-up steps, on {machines}. The GEMMs' "
        f"arithmetic per step (torch's FLOP count of every matrix multiply) and its rate, then CPU seconds per step by op "
        f"category, summed over every thread the profiler saw (so they can exceed a step's wall time; categories read from "
        f"op names: a guide, not an audit; step times are the paired runs' above) "
        f"(`bench/results/train_step_profile_*.json`, `python -m bench train_step profile`):", "",
        "| CPU | recipe | arm | GEMM GFLOP | GEMM GFLOP/s | " + " | ".join(CATS) + " | all ops |",
        "|---|---|---|---|---|" + "---|" * len(CATS) + "---|",
        *[row(x, n) for x in rs for n in ("base", "new")]])
