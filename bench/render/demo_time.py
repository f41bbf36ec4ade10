"""README block `demo_time`: the full demo per stage, per commit, from bench/results/demo_time.json.
The table is _fmt.demo_table, shared with the blocks `demo_time_malloc` and `demo_time_sdpa`."""

from __future__ import annotations

from _fmt import demo_block

FILES = ["demo_time.json"]


def render(results: dict[str, dict]) -> str:
    return "\n".join(demo_block(results["demo_time.json"], "demo_time.json", "one run per column, same machine, same session", note=False))
