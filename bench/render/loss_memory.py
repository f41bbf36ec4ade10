"""docs/benchmarks.md: peak tensor bytes of the teacher + one loss step at Kimi-K2.5's vocabulary."""

from __future__ import annotations

FILES = ["loss_memory.json"]
GiB = 1 << 30


def render(results: dict[str, dict]) -> str:
    r = results["loss_memory.json"]
    s, c = r["shape"], r["cases"]
    g = lambda b: f"{b / GiB:.2f} GiB"  # noqa: E731
    rows = [
        "| loss | peak | teacher kept | `loss_step_bytes` bound | largest fp32 tensor |",
        "|---|---|---|---|---|",
    ]
    for name in ("ce", "lk_hybrid"):
        x = c[name]
        f32 = x["largest_by_dtype"]["float32"]
        rows.append(f"| {name} | **{g(x['peak_bytes'])}** | {g(x['teacher_kept_bytes'])} | {g(x['formula_bytes'])} | "
                    f"{g(f32[0])} {tuple(f32[1])} |")
    p = c["previous_ce"]
    f32 = p["largest_by_dtype"]["float32"]
    rows.append(f"| ce, previous teacher (fp32 probabilities, 8192-row chunks) | {g(p['peak_bytes'])} | {g(p['teacher_kept_bytes'])} | — | "
                f"{g(f32[0])} {tuple(f32[1])} |")
    cm = r["cpu_vs_meta_reduced"]
    return (f"Teacher + one loss step, {s['tokens']:,} tokens, vocabulary {s['vocab']:,} (= draft vocabulary), hidden "
            f"{s['hidden']:,}, {s['dtype']} (`bench/results/loss_memory.json`, `bench/loss_memory.py`; counted op by op on "
            f"the meta device, which counts what the CPU allocates: {cm['meta_peak_bytes']:,} vs {cm['cpu_peak_bytes']:,} "
            f"bytes at a reduced size):\n\n" + "\n".join(rows) + "\n")
