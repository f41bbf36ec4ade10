"""docs/draft-kinds.md: regeneration as a recipe -- EAGLE-3 trained for the same steps on a slice's
original answers, the target's greedy ones and its sampled ones (bench/dflash.py recipe)."""

from __future__ import annotations

from _fmt import cpu, num, seq

FILES = ["regen_recipe.json"]

WHAT = {"original": "the original ShareGPT answers", "greedy": "the target's own, greedy",
        "sampled": "the target's own, sampled at temperature {t:g}"}


def _data(a: dict) -> str:
    d, g = a["data"], a["data"]["regenerate"]
    n = f"{num(d['samples'])} samples, {num(d['answer_tokens'])} answer tokens"
    if g is None:
        return n
    j = g["judged"]
    return f"{n} ({num(j['looping'])} of {num(g['source_n_samples'])} answers looped, left out; {g['engine']} engine)"


def render(results: dict[str, dict]) -> str:
    r = results["regen_recipe.json"]
    arms = r["arms"]
    g = arms["greedy"]["data"]["regenerate"]
    rule, e = g["judged"]["loop_rule"], arms["original"]["eval"]
    lines = [
        f"EAGLE-3 drafts for SmolLM2-135M-Instruct, the demo recipe (`{' '.join(r['train_flags'])}`) for **{r['steps']} steps** "
        f"each, on one slice of ShareGPT conversations whose first answer is the original one or the target's own "
        f"(<= {g['max_new_tokens']} new tokens; an answer loops when at least {rule['min_repeated_share']:.0%} of its "
        f"{rule['ngram']}-grams repeat); decoded on all {r['prompts']} MT-bench first turns, {e['max_new_tokens']} new tokens, "
        f"greedy, chain of {e['steps']}, on {cpu(r)} (`bench/results/regen_recipe.json`, `python -m bench dflash recipe`). "
        f"Else on the CPU meanwhile: {r['alongside']}.",
        "",
        "| answers trained on | data | τ | τ vs the original answers, paired (95 % interval over prompts) | accepted per position | τ its held-out split predicted |",
        "|---|---|---|---|---|---|",
    ]
    for name, a in arms.items():
        e = a["eval"]
        p = a.get("tau_vs_original")
        vs = "(the reference)" if p is None else f"{p['delta']:+.3f} ({p['ci95'][0]:+.3f} … {p['ci95'][1]:+.3f})"
        lines.append(f"| {WHAT[name].format(t=r['temperature'])} | {_data(a)} | **{e['tau']:.3f}** | {vs} | "
                     f"{seq(e['accept_per_position'])} | {a['train']['final_eval']['tau_t0']:.2f} |")
    return "\n".join(lines)
