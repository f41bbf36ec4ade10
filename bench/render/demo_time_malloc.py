"""README block `demo_time_malloc`: glibc's allocator kept vs its defaults, stage probes paired on
one machine, and the full demo with it (bench/results/demo_time_malloc.json, bench/demo_time.py)."""

from __future__ import annotations

from _fmt import demo_table, probe_table

FILES = ["demo_time_malloc.json"]


def _kept(p: dict) -> bool:
    return p["allocator"].startswith("kept")


def pairs(probes: list[dict]) -> dict[str, list[float]]:
    """Per stage, the wall-time change (%) of kept vs glibc defaults over adjacent probes of the same
    stage that differ in the allocator (each probe in one pair at most; order as run)."""
    out: dict[str, list[float]] = {}
    i = 0
    while i + 1 < len(probes):
        a, b = probes[i], probes[i + 1]
        if a["stage"] == b["stage"] and _kept(a) != _kept(b):
            kept, dflt = (a, b) if _kept(a) else (b, a)
            out.setdefault(a["stage"], []).append(100 * (kept["wall_seconds"] - dflt["wall_seconds"]) / dflt["wall_seconds"])
            i += 2
        else:
            i += 1
    return out


def render(results: dict[str, dict]) -> str:
    r = results["demo_time_malloc.json"]
    out = probe_table(r, "demo_time_malloc.json", "Stage probes, run in the order listed (capture: the demo's first 150 "
                      "conversations; train: the demo recipe's first steps on the demo's store, one held-out evaluation; "
                      "eval: the first MT-bench prompts, each decoded speculatively and plainly, with the full demo's draft)")
    ch = pairs(r["probes"])
    out += ["", "Wall time with the heap kept vs glibc's defaults, adjacent pairs: " + "; ".join(
        f"{stage} " + ", ".join(f"{x:+.1f} %" for x in xs) for stage, xs in ch.items()) + "."]
    if r["runs"]:
        out += ["", "The full demo with the allocator kept (`make demo`'s preset), per stage:", "", *demo_table(r["runs"])]
    if r["note"]:
        out += ["", r["note"]]
    return "\n".join(out)
