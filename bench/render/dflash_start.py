"""docs/draft-kinds.md: where an EAGLE-3 and a DFlash draft start and how their cross-entropy falls,
trained for the same steps on one store (bench/dflash.py start), DFlash also before its start was fixed."""

from __future__ import annotations

from statistics import fmean

from _fmt import cpu

FILES = ["dflash_start.json"]

NAMES = {"eagle3": "EAGLE-3", "dflash-b16": "DFlash", "dflash-b16-before": "DFlash, before its start was fixed"}


def windows(n: int) -> list[tuple[int, int]]:
    """1-based inclusive step ranges: a single step is one batch's loss and jumps by a nat between
    batches, so the curve is shown as 10 %-of-the-run means after the first step."""
    w = max(1, n // 10)
    return [(a, min(n, a + w - 1)) for a in sorted({2, n // 2 - w + 1, n - w + 1}) if a >= 2]


def row(name: str, a: dict, spans: list[tuple[int, int]]) -> str:
    c = a["curve_ce_mean"]
    held = a["held_out"]
    flags = " ".join(a["flags"])
    what = f"`{flags}`, {a['commit'][:7]}" if flags else f"the demo recipe, {a['commit'][:7]}"
    return (f"| {NAMES[name]} ({what}) | "
            f"**{a['first_step']['ce_mean']:.1f}** (max {max(a['first_step']['ce_per_position']):.1f}) | "
            f"{a['ln_draft_vocab']:.2f} | "
            + " | ".join(f"{fmean(c[s - 1:e]):.2f}" for s, e in spans)
            + f" | {fmean(held['loss']):.2f} | {held['tau_t0']:.3f} |")


def render(results: dict[str, dict]) -> str:
    r = results["dflash_start.json"]
    n = r["steps"]
    spans = windows(n)
    d = r["data"]
    src = (f"{d['prepared']['limit']} ShareGPT conversations of at most {d['prepared']['max_length']} tokens"
           if d["prepared"] else "the prepared data at `--source`")
    held = next(iter(r["arms"].values()))["held_out"].get("split", "the held-out split")
    return "\n".join([
        f"Training cross-entropy per position (EAGLE-3: TTT step; DFlash: block slot), mean over positions, in "
        f"nats, with the demo recipe (`{' '.join(r['train_flags'])}`) for {n} steps on {src} of {d['target']}, "
        f"on {cpu(r)}; after the last step, the held-out cross-entropy and the τ it predicts ({held}; "
        f"`bench/results/dflash_start.json`, `python -m bench dflash start`):", "",
        "| draft | first step | ln(draft vocabulary) | "
        + " | ".join(f"steps {s}–{e}" for s, e in spans) + " | held-out CE | held-out τ |",
        "|---|---|---|" + "---|" * len(spans) + "---|---|",
        *[row(k, v, spans) for k, v in r["arms"].items()]])
