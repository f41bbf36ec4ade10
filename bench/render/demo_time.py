"""README block `demo_time`: the full demo per stage, per commit, from bench/results/demo_time.json.
The table is _fmt.demo_table, shared with the block `demo_time_malloc`."""

from __future__ import annotations

from _fmt import cpu_kind, demo_table

FILES = ["demo_time.json"]


def render(results: dict[str, dict]) -> str:
    r = results["demo_time.json"]
    cpu = r["cpu"]
    out = [f"CPU: {cpu['cpu_model']} ({cpu_kind(cpu)}), {cpu['cores']} cores; one run per column, same machine, "
           f"same session (`bench/results/demo_time.json`).", "", *demo_table(r["runs"])]
    return "\n".join(out)
