"""README block `demo_time_malloc`: glibc's allocator kept vs its defaults, stage probes paired on
one machine, and the full demo with it (bench/results/demo_time_malloc.json, bench/demo_time.py)."""

from __future__ import annotations

from _fmt import cpu_kind, demo_table

FILES = ["demo_time_malloc.json"]


def _probe_row(p: dict) -> str:
    how = "heap kept (`MALLOC_*` as `keep_freed_heap` sets them)" if p["env"] else "glibc defaults"
    rate = f"{p['tokens_per_s']:,.0f} tok/s" if p["stage"] == "capture" else f"{p['final_tokens_per_s']:,.0f} tok/s ({p['steps']} steps)"
    return (f"| {p['label']} | {p['stage']} | `{p['commit'][:7]}` | {how} | {p['wall_seconds']:.1f} s | {rate} | "
            f"{p['cpu_s']:.0f} s | {p['other_cpu_s']:.0f} s | {p['peak_rss_mb'] / 1024:.1f} GB |")


def render(results: dict[str, dict]) -> str:
    r = results["demo_time_malloc.json"]
    cpu = r["cpu"]
    out = [f"CPU: {cpu['cpu_model']} ({cpu_kind(cpu)}), {cpu['cores']} cores, one session, one command at a time "
           f"(`bench/results/demo_time_malloc.json`). Stage probes, run in the order listed (capture: the demo's first "
           f"150 conversations; train: the demo recipe's first steps on the demo's store, one held-out evaluation):", "",
           "| probe | stage | commit | allocator | wall | rate | CPU time | other work meanwhile (CPU) | peak RSS |",
           "|---|---|---|---|---:|---:|---:|---:|---:|"]
    out += [_probe_row(p) for p in r["probes"]]
    if r["runs"]:
        out += ["", "The full demo with the allocator kept (`make demo`'s preset), per stage:", "", *demo_table(r["runs"])]
    if r["note"]:
        out += ["", r["note"]]
    return "\n".join(out)
