"""README block `draft_kinds`: EAGLE-3 vs EAGLE 3.1 on SmolLM2, GQA vs MLA drafts, from
bench/results/draft_kinds.json (written by bench/draft_kinds.py).  Contract of issue 22: a missing
field raises KeyError; no number is defaulted."""

from __future__ import annotations

FILES = ["draft_kinds.json"]


def _acc(held_out: dict) -> str:
    return " / ".join(f"{a:.3f}" for a in held_out["acc"])


def _tau(e: dict) -> str:
    return f"**{e['tau']:.3f}** ({' / '.join(f'{a:.3f}' for a in e['accept_per_position'])})"


def render(results: dict[str, dict]) -> str:
    r = results["draft_kinds.json"]
    s = r["smollm2"]
    lines = [
        f"SmolLM2-135M, the demo recipe ({' '.join(s['recipe'])}) on the shared demo store, one run per arm (same data, "
        f"steps, seed); tau on all {s['prompts']} MT-bench first turns, our decoder, 3 steps, topk 1, 128 new tokens "
        "(acceptance per draft position in brackets):",
        "",
        "| arm | train flags | held-out accuracy per TTT position | tau, temperature 0 | tau, temperature 1 | train wall |",
        "|---|---|---|---|---|---|",
    ]
    for name, a in s["arms"].items():
        lines.append(f"| {name} | {' '.join(a['flags']) or '(EAGLE-3)'} | {_acc(a['held_out'])} | {_tau(a['eval']['t0'])} | "
                     f"{_tau(a['eval']['t1'])} | {a['timing']['wall_s'] / 60:.1f} min |")
    t = r["tiny_deepseek_v3"]
    lines += [
        "",
        f"The tiny DeepSeek-V3 target ({t['target']}), its own features of the first {t['samples_captured']} demo "
        "conversations, the same recipe in fp32 for both kinds:",
        "",
        "| draft attention | held-out accuracy per TTT position | parameters (attention) | decoding cache per token (bf16) |",
        "|---|---|---|---|",
    ]
    for kind, k in t["kinds"].items():
        lines.append(f"| {kind} | {_acc(k['held_out'])} | {k['parameters']:,} ({k['parameters_by_part']['attention']:,}) | "
                     f"{k['kv_bytes_per_token']:,} B |")
    k = r["kimi_k25_shape"]
    lines += [
        "",
        "At Kimi-K2.5's shape (`train --dry-run`, meta device, full vocabulary as the published drafts):",
        "",
        "| draft attention | parameters | of which attention | decoding cache per token (bf16) |",
        "|---|---|---|---|",
    ]
    for kind, v in k.items():
        lines.append(f"| {kind} | {v['parameters']:,} | {v['parameters_by_part']['attention']:,} | {v['kv_bytes_per_token']:,} B |")
    return "\n".join(lines) + "\n"
