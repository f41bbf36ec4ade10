"""README block `store_outliers`: the fp8 store's schemes on real outliers (bench/store_outliers.py)."""

from __future__ import annotations

FILES = ["store_outliers.json"]

NAMES = {"qwen25-coder": "Qwen2.5-Coder-0.5B", "smollm2": "SmolLM2-135M"}
VARIANTS = {"bf16": "bf16", "fp8-token-layer": "fp8, one scale per (token, layer) (before)",
            "fp8-block128": "**fp8, one scale per 128 values (default)**"}


def _pct(x: float) -> str:
    return f"{100 * x:.3f} %" if x < 0.01 else f"{100 * x:.2f} %"


def _layer(name: str) -> str:
    kind, _, rest = name.partition("_")
    return f"aux {rest}" if kind == "aux" else "final state"


def render(results: dict[str, dict]) -> str:
    r = results["store_outliers.json"]
    lines = []
    for t, m in r["measure"].items():
        lines.append(f"{NAMES[t]} (hidden {m['hidden_size']}): {m['samples']} stored ShareGPT conversations, {m['tokens']:,} tokens.")
    lines += ["",
              "| target, layer | channel RMS max / median | token max / median (median, p99, max) | flushed to 0: per (token, layer) | per 128 values | error (whitened): per (token, layer) | per 128 values | per 128, fp32 scale |",
              "|---|---|---|---|---|---|---|---|"]
    for t, m in r["measure"].items():
        for name, rec in m["layers"].items():
            o, s = rec["outliers"], rec["schemes"]
            tok = o["token_max_over_median"]
            lines.append(
                f"| {NAMES[t]} {_layer(name)} | {o['channel_rms_max_over_median']:,} | {tok['median']:,} / {tok['p99']:,} / {tok['max']:,} "
                f"| {_pct(s['token-layer']['flushed'])} | {_pct(s['block128']['flushed'])} "
                f"| {s['token-layer']['rel_err_whitened']:.4f} | {s['block128']['rel_err_whitened']:.4f} "
                f"| {s['block128-f32']['rel_err_whitened']:.4f} |")
    rec = r["recipe"]
    lines += ["",
              f"τ on Qwen2.5-Coder-0.5B ({rec['prepared_samples']} ShareGPT conversations ≤ {rec['max_length']} tokens, "
              f"{rec['prepared_tokens']:,} tokens; TTT {rec['ttt_steps']}, draft vocab {rec['draft_vocab']:,}, lr {rec['lr']}, "
              f"{rec['batch_tokens']}-token batches, {rec['epochs']} epochs, {rec['train_dtype']}, seed {rec['seed']}: the same batches "
              f"for every store), decoded on all {rec['eval_prompts']} MT-bench first turns ({rec['eval_max_new_tokens']} new tokens, "
              f"chain of {rec['eval_steps']}, greedy):",
              "",
              "| store | bytes/token | held-out accuracy (TTT 1 / 2 / 3) | τ | vs bf16 (paired bootstrap 95 % CI) |",
              "|---|---|---|---|---|"]
    for v, label in VARIANTS.items():
        x = r["variants"][v]
        acc = " / ".join(f"{a:.3f}" for a in x["heldout_acc"])
        if v == "bf16":
            diff = "—"
        else:
            d = x["tau_minus_bf16"]
            diff = f"{d['pct']:+.2f} % ({d['ci95_pct'][0]:+.2f} … {d['ci95_pct'][1]:+.2f} %)"
        lines.append(f"| {label} | {x['bytes_per_token']:,} | {acc} | {x['tau']:.4f} | {diff} |")
    return "\n".join(lines) + "\n"
