"""docs/benchmarks.md: the training losses side by side on the demo's recipe (bench/losses.py)."""

from __future__ import annotations

FILES = ["losses.json"]


def _pos(xs) -> str:
    return " ".join(f"{x:.3f}" for x in xs)


def _pct(x: float) -> str:
    return f"{100 * x:+.1f} %"


def _delta(d: dict) -> str:
    return f"{d['delta']:+.3f} [{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}]"


def render(results: dict[str, dict]) -> str:
    r = results["losses.json"]
    d = r["decode"]
    head = [
        "| arm (`--loss`) | train wall | held-out accept T=0, per position | held-out α (T=1) | τ T=0: predicted by the held-out split → "
        "**decoded** | τ T=1: predicted → **decoded** | decoded τ − `ce`'s (T=0 / T=1), 95 % interval over prompts |",
        "|---|---|---|---|---|---|---|",
    ]
    rows = []
    for name, a in r["arms"].items():
        h, t0, t1 = a["heldout"], a["decoded"]["t0"], a["decoded"]["t1"]
        rows.append(
            f"| {name} (`{' '.join(a['flags'][1:])}`) | {a['train_wall_s'] / 60:.1f} min | {_pos(h['acc'])} | {_pos(h['alpha'])} | "
            f"{t0['predicted_tau_heldout']:.3f} → **{t0['tau']:.3f}** | {t1['predicted_tau_heldout']:.3f} → **{t1['tau']:.3f}** | "
            + (f"{_delta(a['delta_tau_vs_ce']['t0'])} / {_delta(a['delta_tau_vs_ce']['t1'])} |" if name != "l-ce" else "— |"))
    gaps = "; ".join(
        f"{n}: {_pct(a['decoded']['t0']['gap_heldout'])} / {_pct(a['decoded']['t1']['gap_heldout'])}"
        for n, a in r["arms"].items())
    ce = r["arms"]["l-ce"]["decoded"]
    return (
        f"{r['recipe']}; one run per arm, the same data, steps ({r['arms']['l-ce']['steps']:,}) and seed. Decoded: "
        f"{d['prompts']} MT-bench first turns, {d['max_new_tokens']} new tokens, {d['steps']} steps, topk {d['topk']}, "
        f"{d['engine']}; at T=1 the draft's tokens are sampled and verified with min(1, p/q) "
        f"(`bench/results/losses.json`, `bench/losses.py`):\n\n" + "\n".join(head + rows) + "\n\n"
        f"Predicted by the held-out split minus decoded τ, relative (T=0 / T=1): {gaps}. The `ce` arm's decodes: T=0 "
        f"{ce['t0']['verified_tokens']:,} tokens in {ce['t0']['verify_steps']:,} verification steps, T=1 "
        f"{ce['t1']['verified_tokens']:,} in {ce['t1']['verify_steps']:,}."
        + (f" Not run: {', '.join(r['arms_not_run'])}." if r["arms_not_run"] else "") + "\n")
