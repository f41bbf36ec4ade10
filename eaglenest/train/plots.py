"""PNG plots of a run: loss, top-1 accuracy (acceptance at temperature 0) and alpha (acceptance at
temperature 1) per TTT position over steps (train and held-out), and the tau they predict."""

from __future__ import annotations

import json
from pathlib import Path


def plot_run(run_dir: Path | str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if not r.get("skipped")]  # online steps none of whose samples arrived
    if not rows:
        return []
    out = []
    for key, title in (("loss", "training loss"), ("acc", "top-1 accuracy vs target argmax (accept at T=0)"),
                       ("alpha", "alpha = sum min(p, q) (accept at T=1)")):
        K = max((len(r.get(f"train_{key}") or r.get(f"eval_{key}") or []) for r in rows), default=0)
        if K == 0:  # alpha: only evaluations (and alpha-loss runs' training steps) have it
            continue
        fig, ax = plt.subplots(figsize=(7, 4.2))
        cmap = plt.get_cmap("viridis", max(K, 2))
        for j in range(K):
            tr = [(r["step"], r[f"train_{key}"][j]) for r in rows if f"train_{key}" in r]
            if tr:
                ax.plot(*zip(*tr), color=cmap(j), alpha=0.35, lw=1)
            ev = [(r["step"], r[f"eval_{key}"][j]) for r in rows if f"eval_{key}" in r]
            if ev:
                ax.plot(*zip(*ev), color=cmap(j), marker="o", ms=3, lw=1.6, label=f"position {j}")
        ax.set_xlabel("optimizer step")
        # two lines: on one, the accuracy plot's title ran off both edges of the 7-inch figure
        ax.set_title(f"{title} per TTT position\n(thin: train, dots: held-out)", fontsize=10)
        ax.grid(alpha=0.3)
        if any(f"eval_{key}" in r for r in rows):
            ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        p = run_dir / f"{key}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        out.append(p)
    ev = [r for r in rows if "eval_tau_t0" in r]
    if ev:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for key, label in (("tau_t0", "T=0"), ("tau_t1", "T=1, sampled drafts"), ("tau_t1_argmax", "T=1, argmax drafts")):
            pts = [(r["step"], r[f"eval_{key}"]) for r in ev if f"eval_{key}" in r]
            if pts:
                ax.plot(*zip(*pts), marker="o", ms=3, lw=1.6, label=label)
        ax.set_xlabel("optimizer step")
        ax.set_title(f"predicted tau at {ev[-1]['eval_serve_steps']} serve steps\n(held-out, teacher-forced)", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        p = run_dir / "tau.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        out.append(p)
    return out
