"""The run's PNG plots (eaglenest/train/plots.py) keep their titles inside the image."""

from __future__ import annotations

import json


def test_every_plot_title_fits_inside_its_figure(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from eaglenest.train.plots import plot_run

    rows = []
    for step in range(1, 41):
        r = {"step": step, "train_loss": [3.0, 3.1, 3.2], "train_acc": [0.2, 0.15, 0.1]}
        if step % 20 == 0:
            r.update(eval_loss=[2.5] * 3, eval_acc=[0.3, 0.2, 0.1], eval_alpha=[0.3, 0.2, 0.1],
                     eval_tau_t0=1.4, eval_tau_t1=1.3, eval_tau_t1_argmax=1.35, eval_serve_steps=3)
        rows.append(r)
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")

    figures = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: (figures.append(fig), close(fig)))
    written = plot_run(tmp_path)
    assert sorted(p.name for p in written) == ["acc.png", "alpha.png", "loss.png", "tau.png"]
    assert len(figures) == 4
    for fig in figures:
        renderer = FigureCanvasAgg(fig).get_renderer()  # plt.close detached its own canvas
        (ax,) = fig.axes
        box, page = ax.title.get_window_extent(renderer), fig.bbox
        assert page.x0 <= box.x0 and box.x1 <= page.x1 and box.y1 <= page.y1, (ax.get_title(), box, page)
