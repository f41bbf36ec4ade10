"""docs/benchmarks.md: the TTT attention kernels in the real training step (bench/train_attn.py)."""

from __future__ import annotations

from _fmt import cpu

FILES = ["train_attn_cpu.json"]


def render(results: dict[str, dict]) -> str:
    r = results["train_attn_cpu.json"]
    ref, s = r["reference"], r["summary"]
    others = [k for k in s if k != ref]
    parts = []
    for k in others:
        per = ", ".join(f"{x:.2f}x" for x in s[k]["step_time_vs_ref_per_round"])
        parts.append(f"`{k}` takes {per} of `{ref}`'s step time (round by round; {s[k]['mean_seconds_per_step']:.2f} vs "
                     f"{s[ref]['mean_seconds_per_step']:.2f} s a step on average), losses within "
                     f"{100 * s[k]['loss_max_rel_diff_vs_ref']:.2f} % of `{ref}`'s over the same {r['steps_timed']} steps")
    return (
        f"- The TTT attention on a CPU under bf16 autocast (`--attn-impl auto` = `sdpa`; `eager` in fp32) is torch's fused flash kernel, with the gradient "
        f"of its log-sum-exp (which the exact merge of the diagonal keys needs and torch's backward does not take) "
        f"added in eaglenest's backward; `eager` materializes the scores. In the real training step ({r['recipe']}, "
        f"real SmolLM2 features, {cpu(r)}, {len(r['rounds'])} rounds alternating the kernels, each a fresh process): "
        + "; ".join(parts) + " (`bench/results/train_attn_cpu.json`). In fp64 both give the same loss and gradients "
        "(`tests/test_fastpath.py`)."
    )
