"""README block `draft_kinds`: EAGLE-3 vs EAGLE 3.1 on SmolLM2, GQA vs MLA drafts, from
bench/results/draft_kinds.json (written by bench/draft_kinds.py).  Contract of issue 22: a missing
field raises KeyError; no number is defaulted."""

from __future__ import annotations

FILES = ["draft_kinds.json"]


def _acc(held_out: dict) -> str:
    return " / ".join(f"{a:.3f}" for a in held_out["acc"])


def _tau(e: dict) -> str:
    return f"**{e['tau']:.3f}** ({' / '.join(f'{a:.3f}' for a in e['accept_per_position'])})"


def _delta(a: dict, t: str) -> str:
    if "delta_tau_vs_k-eagle3" not in a:
        return "(reference)"
    d = a["delta_tau_vs_k-eagle3"][t]
    return f"{d['delta']:+.3f} [{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}]"


def _table(intro: str, header: list[str], rows: list[list[str]]) -> list[str]:
    return ["", intro, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def render(results: dict[str, dict]) -> str:
    r = results["draft_kinds.json"]
    s, t, k = r["smollm2"], r["tiny_deepseek_v3"], r["kimi_k25_shape"]
    lines = _table(
        f"SmolLM2-135M, the demo recipe (`{' '.join(s['recipe'])}`) on the shared demo store, one run per arm (same data, "
        f"steps, seed); tau on all {s['prompts']} MT-bench first turns, our decoder, 3 steps, topk 1, 128 new tokens "
        "(acceptance per draft position in brackets; the difference to EAGLE-3 with a 95 % interval from resampling the "
        "prompts, paired):",
        ["arm", "train flags", "held-out accuracy per TTT position", "tau, temperature 0", "vs EAGLE-3", "tau, temperature 1",
         "vs EAGLE-3"],
        [[name, " ".join(a["flags"]) or "(EAGLE-3)", _acc(a["held_out"]), _tau(a["eval"]["t0"]), _delta(a, "t0"), _tau(a["eval"]["t1"]),
          _delta(a, "t1")] for name, a in s["arms"].items()])  # wall times: taken on a shared machine, not compared
    carried = [n for n, a in s["arms"].items() if "carried_from" in a]
    if carried:
        c = s["arms"][carried[0]]["carried_from"]
        lines += ["", f"{', '.join(carried)}: trained and decoded on another machine, reported by an earlier run of the script "
                      f"({c['date'][:10]}, commit {c['git_commit'][:7]}, {c['machine']['cpu_model']}) and carried in the file as "
                      "it wrote them (each arm's train and decode commits are in its provenance)."]
    refs = {n: a["eagle3_reference"] for n, a in s["arms"].items() if "eagle3_reference" in a and "carried_from" not in a}
    if refs:
        r = next(iter(refs.values()))
        lines += ["", f"{', '.join(refs)}: \"vs EAGLE-3\" is paired with the EAGLE-3 recipe re-run on the machine that trained "
                      f"them (`{r['arm']}` of `bench/losses.py`, the same argv: tau {r['tau']['t0']:.3f} at temperature 0, "
                      f"{r['tau']['t1']:.3f} at 1), not with the k-eagle3 row."]
    if s["arms_not_run"]:
        lines += ["", f"Not run (no time on this machine): {', '.join(s['arms_not_run'])}."]
    if t["kinds"]:
        lines += _table(
            f"The tiny DeepSeek-V3 target ({t['target']}), its own features of the first {t['samples_captured']} demo "
            "conversations, the same recipe in fp32 and the whole vocabulary for both kinds:",
            ["draft attention", "held-out accuracy per TTT position", "parameters (attention)", "decoding cache per token (bf16)"],
            [[kind, _acc(v["held_out"]), f"{v['parameters']:,} ({v['parameters_by_part']['attention']:,})", f"{v['kv_bytes_per_token']:,} B"]
             for kind, v in t["kinds"].items()])
    if "carried_from" in t:
        c = t["carried_from"]
        lines += ["", f"(Trained on another machine, reported by an earlier run of the script: {c['date'][:10]}, commit "
                      f"{c['git_commit'][:7]}, {c['machine']['cpu_model']}.)"]
    if t["kinds_not_run"]:
        lines += ["", f"The tiny DeepSeek-V3 target, GQA vs MLA draft: not trained to the end on this machine "
                      f"({', '.join(t['kinds_not_run'])})."]
    lines += _table(
        "At Kimi-K2.5's shape (`train --dry-run`, meta device, full vocabulary as the published drafts):",
        ["draft attention", "parameters", "of which attention", "decoding cache per token (bf16)"],
        [[kind, f"{v['parameters']:,}", f"{v['parameters_by_part']['attention']:,}", f"{v['kv_bytes_per_token']:,} B"] for kind, v in k.items()])
    return "\n".join(lines[1:]) + "\n"
