"""README block `demo_time_sdpa`: the full demo per stage once the CPU training attention became
torch's flash kernel (bench/results/demo_time_sdpa.json; the table is _fmt.demo_table)."""

from __future__ import annotations

from _fmt import demo_block

FILES = ["demo_time_sdpa.json"]


def render(results: dict[str, dict]) -> str:
    return "\n".join(demo_block(results["demo_time_sdpa.json"], "demo_time_sdpa.json", "`make demo`'s preset, one run"))
