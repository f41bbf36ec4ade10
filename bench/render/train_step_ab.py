"""docs/benchmarks.md: the training step, this trainer vs the commit before it, paired on a CPU
(bench/train_step.py ab), one row per recipe and CPU kind."""

from __future__ import annotations

from _fmt import cpu, seq

# every recipe's file of every CPU kind (train_step_ab_<recipe>_<cpu kind>.json): a run on another kind of
# CPU adds its file and its rows, no code; the rows say their CPU from the data's `cpu_kind`
FILES = ["train_step_ab_*_*.json"]


def row(r: dict, kinds: bool, commits: bool) -> str:
    s, d, t = r["summary"], r["data"], r["tolerance"]
    acc = s["eval_acc"]
    dn, dc = s["loss_divergence_from_base"]["new"], s["loss_divergence_from_base"]["control"]
    return ((f"| {r['cpu_kind']} " if kinds else "") + (f"| {r['arms']['new']['commit'][:7]} " if commits else "")
            + f"| {r['recipe']} ({d['conversations']} conversations of at most {d['max_length']:,} tokens, TTT "
            f"{r['train_flags'][r['train_flags'].index('--ttt-steps') + 1]}, {r['train_flags'][r['train_flags'].index('--dtype') + 1]}, "
            f"{r['steps']} steps) | "
            f"{s['step_s_median']['base']:.3f} → {s['step_s_median']['new']:.3f} s | **{s['speedup_median']:.2f}x** "
            f"({seq(s['speedup_per_round'])}) | {s['peak_rss_gib']['base']:.2f} → {s['peak_rss_gib']['new']:.2f} GiB | "
            f"{100 * dn['first_steps_max']:.2f} % over the first {t['first_steps']} steps; {100 * dn['window_max']:.1f} % "
            f"(control {100 * dc['window_max']:.1f} %) | "
            f"{seq(acc['base'], 3)} → {seq(acc['new'], 3)} |")


def render(results: dict[str, dict]) -> str:
    rs = sorted(results.values(), key=lambda x: (x["recipe"], x["cpu_kind"]))
    r = rs[0]
    machines = list(dict.fromkeys(f"{cpu(x)} ({x['cpu_kind']})" for x in rs))
    kinds = len({x["cpu_kind"] for x in rs}) > 1  # a CPU column only once there is more than one kind to tell apart
    # a commit column where the rows measured different commits of this work (a file re-run after a fix)
    commits = len({x["arms"]["new"]["commit"] for x in rs}) > 1
    new = "the commit in each row" if commits else f"commit {r['arms']['new']['commit'][:7]}"
    return "\n".join([
        f"The training step of `eaglenest train` at {new} vs the commit before this work "
        f"({r['arms']['base']['commit'][:7]}), paired: fresh processes in alternating order, one ratio per round (the rounds in each row), each the "
        f"whole training run (its optimizer steps in the recipe column) on real SmolLM2 features, step time the median from step {r['timed_from_step']}, "
        f"on {', '.join(machines)}. Losses: the largest relative difference from the base run, step by step over "
        f"the first steps, then of {r['tolerance']['window']}-step means over the run, beside a control run of the base "
        f"commit with another attention kernel (`{' '.join(r['arms']['control']['extra_flags'])}`: the same function, "
        f"another rounding order); held-out accuracy per TTT position after the last step (`bench/results/train_step_ab_*.json`):", "",
        ("| CPU " if kinds else "") + ("| commit " if commits else "") + "| recipe | step time | speedup (per round) | peak RSS | losses apart | held-out accuracy |",
        ("|---" if kinds else "") + ("|---" if commits else "") + "|---|---|---|---|---|---|", *[row(x, kinds, commits) for x in rs]])
