"""PNG plots of a run: loss and top-1 accuracy per TTT position over steps (train and held-out)."""

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
    for key, title in (("loss", "soft cross-entropy"), ("acc", "top-1 accuracy vs target argmax")):
        fig, ax = plt.subplots(figsize=(7, 4.2))
        K = len(rows[0][f"train_{key}"])
        cmap = plt.get_cmap("viridis", max(K, 2))
        steps = [r["step"] for r in rows]
        for j in range(K):
            ax.plot(steps, [r[f"train_{key}"][j] for r in rows], color=cmap(j), alpha=0.35, lw=1)
            ev = [(r["step"], r[f"eval_{key}"][j]) for r in rows if f"eval_{key}" in r]
            if ev:
                ax.plot(*zip(*ev), color=cmap(j), marker="o", ms=3, lw=1.6, label=f"position {j}")
        ax.set_xlabel("optimizer step")
        ax.set_title(f"{title} per TTT position (thin: train, dots: held-out)")
        ax.grid(alpha=0.3)
        if any(f"eval_{key}" in r for r in rows):
            ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        p = run_dir / f"{key}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        out.append(p)
    return out
