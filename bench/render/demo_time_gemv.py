"""README block `demo_time_gemv`: the full demo per stage once the eval's linears ran in eaglenest's
gemv kernel (bench/results/demo_time_gemv.json; the table is _fmt.demo_table)."""

from __future__ import annotations

from _fmt import demo_block

FILES = ["demo_time_gemv.json"]


def render(results: dict[str, dict]) -> str:
    return "\n".join(demo_block(results["demo_time_gemv.json"], "demo_time_gemv.json", "`make demo`'s preset, one run"))
