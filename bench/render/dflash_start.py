"""docs/draft-kinds.md: where an EAGLE-3 and a DFlash draft start and how their cross-entropy falls,
trained for the same steps on one store (bench/dflash.py start), DFlash also before its start was fixed."""

from __future__ import annotations

from _fmt import cpu, seq

FILES = ["dflash_start.json"]

NAMES = {"eagle3": "EAGLE-3", "dflash-b16": "DFlash", "dflash-b16-before": "DFlash, before its start was fixed"}


def row(name: str, a: dict, marks: list[int]) -> str:
    c = a["curve_ce_mean"]
    held = a["held_out"]["acc"]
    return (f"| {NAMES[name]} (`{' '.join(a['flags']) or 'the demo recipe'}`, {a['commit'][:7]}) | "
            f"**{a['first_step']['ce_mean']:.1f}** (max {max(a['first_step']['ce_per_position']):.1f}) | {a['ln_draft_vocab']:.2f} | "
            + " | ".join(f"{c[m - 1]:.2f}" for m in marks)
            + f" | {seq(held[:3], 3)} |")


def render(results: dict[str, dict]) -> str:
    r = results["dflash_start.json"]
    n = r["steps"]
    marks = sorted({1, max(1, n // 10), max(1, n // 2), n})
    d = r["data"]
    src = (f"{d['prepared']['limit']} ShareGPT conversations of at most {d['prepared']['max_length']} tokens"
           if d["prepared"] else "the prepared data at `--source`")
    return "\n".join([
        f"Cross-entropy per position (EAGLE-3: TTT step; DFlash: block slot), mean over positions, in nats, with the "
        f"demo recipe (`{' '.join(r['train_flags'])}`) for {n} steps on {src} of {d['target']}, on {cpu(r)}; "
        f"held-out accuracy of the first three positions after the last step (`bench/results/dflash_start.json`, "
        f"`python -m bench dflash start`):", "",
        "| draft | first step | ln(draft vocabulary) | " + " | ".join(f"step {m}" for m in marks) + " | held-out accuracy |",
        "|---|---|---|" + "---|" * len(marks) + "---|",
        *[row(k, v, marks) for k, v in r["arms"].items()]])
