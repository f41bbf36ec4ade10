"""docs/benchmarks.md: `eval --workers N` (bench/eval_workers.py)."""

from __future__ import annotations

FILES = ["eval_workers_cpu.json"]


def render(results: dict[str, dict]) -> str:
    r = results["eval_workers_cpu.json"]
    one, two = r["runs"]["1"], r["runs"]["2"]
    same = "identical" if r["same_outputs"] else "**different**"
    return (
        f"- `eval --workers N` decodes the conversations in N processes (cores / N threads each). Batch-1 decoding of a "
        f"small target is latency-bound, so 2 one-thread processes on 2 cores finish the same evaluation sooner than one "
        f"2-thread process: {two['eval_elapsed_s']:.0f} vs {one['eval_elapsed_s']:.0f} s "
        f"(**{r['speedup_vs_1']['2']:.2f}x**, the second model load included) for {r['limit']} MT-bench prompts × "
        f"{r['max_new_tokens']} tokens, speculative and plain decoding of each, with {same} outputs in the "
        f"{r['outputs_compared']} generations compared (`bench/results/eval_workers_cpu.json`)."
    )
