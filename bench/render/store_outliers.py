"""docs/benchmarks.md: the fp8 store's schemes on real outliers (bench/store_outliers.py)."""

from __future__ import annotations

FILES = ["store_outliers.json"]

NAMES = {"qwen25-coder": "Qwen2.5-Coder-0.5B", "smollm2": "SmolLM2-135M"}
VARIANTS = {"bf16": "bf16", "fp8-token-layer": "fp8, one scale per (token, layer) (the scheme before)",
            "fp8-block128": "**fp8, one scale per 128 values (the default)**"}


def _pct(x: float) -> str:
    return "0" if x == 0 else f"{100 * x:.3f} %" if x < 0.01 else f"{100 * x:.2f} %"


def _layer(name: str) -> str:
    kind, _, rest = name.partition("_")
    return f"aux {rest}" if kind == "aux" else "final state"


def _span(values: list[float], fmt: str) -> str:
    lo, hi = min(values), max(values)
    return format(lo, fmt) if lo == hi else f"{format(lo, fmt)}–{format(hi, fmt)}"


def render(results: dict[str, dict]) -> str:
    r = results["store_outliers.json"]
    meas = r["measure"]
    lines = ["Measured on the stored bf16 states (`bench/store_outliers.py measure`; per layer: channel RMS over all tokens, "
             "max / median; per token: largest |x| / median |x|; flushed = share of non-zero values decoded as 0; "
             "whitened error = ‖x̂ − x‖ / ‖x‖ with every channel divided by its RMS, as the draft's fc sees it): "
             + "; ".join(f"{NAMES[t]} (hidden {m['hidden_size']}, aux layers {m['aux_layer_ids']}), {m['samples']} ShareGPT "
                         f"conversations, {m['tokens']:,} tokens" for t, m in meas.items()) + ". \"Per 128 values\" is the "
             "default block, the largest divisor of the hidden size up to 128: "
             + ", ".join(f"{m['block128_values']} for {NAMES[t]}" for t, m in meas.items()) + ".",
             "",
             "| target, layer | channel RMS max / median | token max / median: median, p99, max | flushed, one scale per (token, layer) "
             "| flushed, per 128 values | whitened error, per (token, layer) | per 128 values | per 128, fp32 scale |",
             "|---|---|---|---|---|---|---|---|"]
    for t, m in meas.items():
        for name, rec in m["layers"].items():
            o, s = rec["outliers"], rec["schemes"]
            tok = o["token_max_over_median"]
            lines.append(
                f"| {NAMES[t]} {_layer(name)} | {o['channel_rms_max_over_median']:,} | {tok['median']:,}, {tok['p99']:,}, {tok['max']:,} "
                f"| {_pct(s['token-layer']['flushed'])} | {_pct(s['block128']['flushed'])} "
                f"| {s['token-layer']['rel_err_whitened']:.4f} | {s['block128']['rel_err_whitened']:.4f} "
                f"| {s['block128-f32']['rel_err_whitened']:.4f} |")
    every = [rec for m in meas.values() for rec in m["layers"].values()]
    first = [rec["schemes"]["token-layer"]["flushed_first_token"] for rec in every]
    raw = [(rec["schemes"]["token-layer"]["rel_err"], rec["schemes"]["block128-f32"]["rel_err"], rec["schemes"]["token-layer-keep8"]["rel_err"])
           for rec in every]
    big = max(range(len(raw)), key=lambda i: raw[i][0])
    q = meas["qwen25-coder"]
    lines += ["",
              f"The largest value of a token is at most {max(rec['outliers']['token_max_over_median']['max'] for rec in every):,.0f} "
              f"times its median (always the first token, an attention sink; share of tokens over a thousand times it: "
              f"{_span([rec['outliers']['tokens_over_1e3'] for rec in every], '.0%')}). One scale per (token, layer) flushes "
              f"{_span([rec['schemes']['token-layer']['flushed'] for rec in every], '.3%')} of the values "
              f"({_span(first, '.1%')} of the first token's), one per 128 values "
              f"{_span([rec['schemes']['block128']['flushed'] for rec in every], '.3%')}; the whitened error is "
              f"{_span([rec['schemes'][s]['rel_err_whitened'] for rec in every for s in ('token-layer', 'block128')], '.3f')} "
              f"for both. An fp32 scale per block (exact block maximum, an fp32 per 128 values, no exact bf16 decode) or "
              f"the 8 largest values of each (token, layer) kept in bf16 (+{100 * (q['bytes_per_value']['token-layer-keep8'] - 1):.1f} % "
              f"bytes at hidden {q['hidden_size']}) cut the raw error of the layers with a massive channel (e.g. "
              f"{raw[big][0]:.4f} -> {raw[big][1]:.4f} / {raw[big][2]:.4f}), hardly the whitened one; keeping e4m3 "
              f"subnormals instead of flushing them leaves {_span([rec['schemes']['token-layer-subnormals']['flushed'] for rec in every], '.4%')} "
              f"flushed with one scale per (token, layer).",
              ""]
    rec = r["recipe"]
    trained = [v for v in VARIANTS if "tau" in r["variants"].get(v, {})]
    kimi = r["bytes_per_token_kimi_k25_shape"]
    if "bf16" not in trained or len(trained) < 2:  # nothing to compare yet: say so, show what was measured
        lines += [f"τ on Qwen2.5-Coder-0.5B: **not measured** (the recipe -- {rec['prepared_samples']} conversations, "
                  f"{rec['epochs']} epochs, all {rec['eval_prompts']} MT-bench first turns -- trained and decoded for each "
                  f"store is hours per store on this 2-core machine; trained and decoded so far: "
                  f"{', '.join(trained) or 'none'}). Bytes per token of each store:",
                  "",
                  "| store | bytes/token Qwen2.5-Coder-0.5B (measured on disk) | bytes/token Kimi-K2.5 shape |",
                  "|---|---|---|"]
        for v, label in VARIANTS.items():
            x = r["variants"].get(v, {})
            disk = f"{x['bytes_per_token']:,} ({x['bytes_on_disk_per_token']:,})" if "bytes_per_token" in x else "store not written"
            lines.append(f"| {label} | {disk} | {kimi[v]:,} |")
        return "\n".join(lines) + "\n"
    lines += [f"τ on Qwen2.5-Coder-0.5B: {rec['prepared_samples']} ShareGPT conversations ≤ {rec['max_length']} tokens "
              f"({rec['prepared_tokens']:,} tokens), TTT {rec['ttt_steps']}, draft vocabulary {rec['draft_vocab']:,}, lr {rec['lr']}, "
              f"{rec['batch_tokens']}-token batches, {rec['epochs']} epochs, {rec['train_dtype']} autocast, seed {rec['seed']}: the same "
              f"batches for every store, which alone differs; decoded on all {rec['eval_prompts']} MT-bench first turns "
              f"({rec['eval_max_new_tokens']} new tokens, chain of {rec['eval_steps']}, greedy, exact verification).",
              "",
              f"| store | bytes/token (Kimi-K2.5 shape) | held-out accuracy, TTT {' / '.join(str(j + 1) for j in range(rec['ttt_steps']))} "
              "| τ | τ vs bf16 (paired bootstrap 95 % CI) | text = bf16's |",
              "|---|---|---|---|---|---|"]
    for v, label in VARIANTS.items():
        if v not in trained:
            continue
        x = r["variants"][v]
        acc = " / ".join(f"{a:.3f}" for a in x["heldout_acc"])
        if v == "bf16":
            diff, same = "—", "—"
        else:
            d = x["tau_minus_bf16"]
            diff = f"{d['pct']:+.2f} % ({d['ci95_pct'][0]:+.2f} … {d['ci95_pct'][1]:+.2f} %)"
            same = f"{x['texts_identical_to_bf16']} of {x['texts_compared']}"
        lines.append(f"| {label} | {x['bytes_per_token']:,} ({kimi[v]:,}) | {acc} | {x['tau']:.4f} | {diff} | {same} |")
    if missing := [VARIANTS[v] for v in VARIANTS if v not in trained]:
        lines += ["", f"Not trained and decoded on this machine (no time): {'; '.join(missing)}."]
    return "\n".join(lines) + "\n"
