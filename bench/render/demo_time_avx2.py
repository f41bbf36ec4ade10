"""README block `demo_time_avx2`: the demo's stages probed on a CPU without bf16 matrix instructions
(bench/results/demo_time_avx2.json, bench/demo_time.py probe)."""

from __future__ import annotations

from _fmt import probe_table

FILES = ["demo_time_avx2.json"]


def render(results: dict[str, dict]) -> str:
    r = results["demo_time_avx2.json"]
    out = probe_table(r, "demo_time_avx2.json", "The full demo was not run on this CPU; its stages were probed one at a "
                      "time with `make demo`'s settings as they resolve there (capture: the target in fp32 with bf16 "
                      "states, the demo's first conversations, as many as the label says; train: the recipe in fp32, its "
                      "first steps on that store, one held-out evaluation included in the wall time)")
    if r["note"]:
        out += ["", r["note"]]
    return "\n".join(out)
