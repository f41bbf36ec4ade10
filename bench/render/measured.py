"""README *Numbers*: one table row per benchmark, each from its result files (bench/report.py).

To add a row: a function taking the parsed result files (in the order listed) and returning
(what was measured, the result), and one line in ROWS naming its files."""

from __future__ import annotations

from _fmt import cpu, num, ratio, seq

HEADER = ["| what | result | file |", "|---|---|---|"]


def capture(r):
    return (f"capture vs plain forward (SmolLM2, {r['dtype']}, {r['samples']} ShareGPT samples, {cpu(r)})",
            f"{num(r['capture_tokens_per_s'])} vs {num(r['plain_forward_tokens_per_s'])} tok/s (**{r['ratio']:.2f}x**), "
            f"{num(r['bytes_per_token'])} bytes/token")


def train_step(*rs):
    cells = []
    for r in rs:
        cells.append(f"T {r['seq']}: {r['ours']['tokens_per_s']:.1f} vs {r['ours_eager']['tokens_per_s']:.1f} tok/s, "
                     f"peak RSS {r['ours']['peak_gib']:.2f} vs {r['ours_eager']['peak_gib']:.2f} GiB")
    r = rs[0]
    return (f"training step, SmolLM2-shaped draft (TTT {r['ttt']}, draft vocab {r['shape_dims']['Vd']:,}), CPU, "
            f"{r['torch_threads']} thread: chunked vs eager attention, median of {r['steps']} steps ({cpu(r)})",
            "; ".join(cells) + "; losses identical" * all(x["ours_detail"]["losses"] == x["ours_eager_detail"]["losses"] for x in rs))


def train_dtype(r):
    f, b = r["runs"]["fp32"], r["runs"]["bf16"]
    acc = r["heldout_acc_after_steps"]
    return (f"real trainer on the CPU, demo recipe, {r['steps_per_phase']} steps: fp32 vs bf16 autocast ({cpu(r)})",
            f"{num(f['first_epoch']['tokens_per_s'])} vs {num(b['first_epoch']['tokens_per_s'])} tok/s "
            f"(**{r['bf16_speedup']['first_epoch']:.2f}x**); with the argmax cached (epochs ≥ 2) "
            f"{num(f['argmax_cached']['tokens_per_s'])} vs {num(b['argmax_cached']['tokens_per_s'])}; losses within "
            f"{100 * r['loss_max_rel_diff_first_epoch']:.1f} %; held-out accuracy after {acc['steps']} steps "
            f"{seq(acc['fp32'], 3)} vs {seq(acc['bf16'], 3)}")


def train_memory(r):
    before, after = (next(x for x in r["runs"] if x["mode"] == m) for m in ("before", "after"))
    return (f"host memory of CPU training, {before['steps']} steps of the demo recipe: oneDNN cache "
            f"{before['onednn_cache']} kernels, no heap trims vs eaglenest's defaults ({after['onednn_cache']} kernels, "
            f"trim every {after['trim_every']} steps; {cpu(r)})",
            f"private RSS peak {before['rss_anon_mb_peak'] / 1e3:.1f} vs {after['rss_anon_mb_peak'] / 1e3:.1f} GB "
            f"(at the end {before['rss_anon_mb_end'] / 1e3:.1f} vs {after['rss_anon_mb_end'] / 1e3:.1f}); "
            f"{num(before['tokens_per_s'])} vs {num(after['tokens_per_s'])} tok/s")


def eval_workers(r):
    one, two = r["runs"]["1"], r["runs"]["2"]
    same = "identical" if r["same_outputs"] else "**different**"
    return (f"`eval --workers 2` vs 1 on {r['machine']['cpu_count']} cores ({r['limit']} MT-bench prompts × "
            f"{r['max_new_tokens']} tokens, plain decoding of every prompt too; {cpu(r)})",
            f"whole eval {two['eval_elapsed_s']:.0f} vs {one['eval_elapsed_s']:.0f} s (**{r['speedup_vs_1']['2']:.2f}x**, "
            f"model loads included); per-process decode {two['spec_tokens_per_s_per_process']:.1f} vs "
            f"{one['spec_tokens_per_s_per_process']:.1f} tok/s; speculative outputs {same} in the "
            f"{r['outputs_compared']} generations compared")


def sglang(r):
    g, c = r["greedy"], r["min_token_cosine"]
    return (f"SGLang live on this CPU (torch-native engine started by `--sglang-serve`, eaglenest's plugin) vs the hf "
            f"engine, SmolLM2 {r['dtype']}, {r['samples']} ShareGPT samples ({cpu(r)})",
            f"per-token cosine ≥ **{c['aux_layers']}** (aux layers) / **{c['final_state']}** (final state), "
            f"{len(r['failures'])} failures; greedy identical on {g['equal']} of {g['texts_compared']} prompts "
            f"({g['prompt_tokens']} prompt tokens, {g['max_new_tokens']} new); server ready in "
            f"{r['server_start_to_first_answer_s']:.0f} s; capture {num(r['capture_tokens_per_s']['sglang_plugin'])} vs "
            f"{num(r['capture_tokens_per_s']['hf'])} tok/s")


def online(r):
    off, on, s = r["arms"]["offline"], r["arms"]["online"], r["summary"]
    d = s["tau"]["online_minus_offline"]
    return (f"online vs offline training (`train --online --engine hf` vs capture + train), demo recipe on "
            f"{r['recipe']['samples']} conversations ({cpu(r)})",
            f"{on['wall_s']:.0f} s vs {off['wall_s']:.0f} s wall ({s['wall_online_over_offline']:.2f}x), peak RSS "
            f"{on['peak_rss_mb'] / 1e3:.1f} vs {off['peak_rss_mb'] / 1e3:.1f} GB, no store vs "
            f"{s['feature_store_bytes_offline'] / 2**20:,.0f} MiB, **τ {s['tau']['online']:.3f} vs {s['tau']['offline']:.3f}** "
            f"({r['recipe']['eval']['limit']} MT-bench questions; difference {d['diff']:+.3f}, 95 % interval "
            f"[{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}])")


def verification(r):
    f, d = r["forward_ms_median"], r["decoding"]
    rowwise = ", ".join("x".join(map(str, x["shape"])) for x in r["verification"]["rowwise"]["linears"]) or "none"
    return (f"exact verification on {cpu(r)} (SmolLM2 bf16, {r['threads']} thread): 4-token verification forward with "
            f"the probe's setting (Linears found batch-dependent here: {rowwise}) vs attention-only row-wise vs every "
            f"Linear row-wise; speculative decoding, {r['prompts']} MT-bench prompts × {r['max_new_tokens']} tokens",
            f"{f['probe']:.0f} vs {f['attention']:.0f} vs {f['all_linears']:.0f} ms (one-token decode {f['decode_1_row']:.0f}); "
            f"{d['probe']['tokens_per_s']:.1f} tok/s with the probe's setting vs {d['plain']['tokens_per_s']:.1f} plain; "
            f"greedy == plain on {d['probe']['same_as_plain']} of {r['texts_compared']} prompts (probe) and "
            f"{d['model']['same_as_plain']} of {r['texts_compared']} (`--attention model`)")


def vllm_t1(r, draft="the quick demo's"):
    x = r["bf16"]
    fixed = "our CPU fix applied" if any("replaced" in f for f in r["vllm_fixes"]) else "vLLM unpatched"
    return (f"τ at temperature {r['temperature']:g}, {r['draft_sampling']} drafts: vLLM {r['vllm_version']} (`draft_sample_method: "
            f"{r['vllm_speculative_config']['draft_sample_method']}`, {fixed}) vs our decoder, the same draft ({draft}) "
            f"and {x['prompts']} MT-bench prompts × {r['max_new_tokens']} tokens, bf16 ({cpu(r)})",
            f"**{x['tau_vllm']:.3f} vs {x['tau_ours']:.3f}** ({100 * x['relative_gap']:.1f} % apart); accept per position "
            f"{seq(x['accept_per_position_vllm'], 3)} vs {seq(x['accept_per_position_ours'], 3)}")


def gpu_train_step(*rs):
    """eaglenest vs SpecForge 0.2.0 on the same inputs, where SpecForge ran; ours alone past that."""
    cells = []
    for r in rs:
        o = r["ours"]
        if "specforge" in r:
            f = r["specforge"]
            cells.append(f"T {r['seq']:,}: {num(o['tokens_per_s'])} vs {num(f['tokens_per_s'])} tok/s (**{r['speedup']:.2f}x**), "
                         f"peak {o['peak_gib']:.1f} vs {f['peak_gib']:.1f} GiB")
        else:
            cells.append(f"T {r['seq']:,}: ours {num(o['tokens_per_s'])} tok/s, peak {o['peak_gib']:.1f} GiB"
                         f"{' (per-step recompute)' if r['ours_detail']['recompute'] else ''}, SpecForge not run at this length")
    r = rs[0]
    v = r["versions"]
    return (f"training step on {r['device']}, Llama-3-8B-shaped draft (TTT {r['ttt']}, draft vocab {r['shape_dims']['Vd']:,}), "
            f"one sequence: eaglenest (compiled flex) vs SpecForge {v['specforge']} (its flex attention), same inputs, "
            f"median of {'–'.join(str(n) for n in sorted({x['steps'] for x in rs}))} steps after {r['warmup']} warm-up, torch {v['torch']}",
            "; ".join(cells))


def capture_gpu(r):
    return (f"capture vs plain forward on {r['device']} ({r['target'].split(',')[0]} at Llama-3-8B size, {r['dtype']}, "
            f"{r['samples']} samples, {num(r['tokens'])} tokens, layers {', '.join(map(str, r['layer_ids']))})",
            f"{num(r['capture_tokens_per_s'])} vs {num(r['plain_forward_tokens_per_s'])} tok/s ({r['ratio']:.3f}x); with the "
            f"device→host copy overlapped {num(r['overlap_capture_tokens_per_s'])} (**{r['overlap_ratio']:.3f}x**); peak {r['peak_gib']:.1f} GiB")


ROWS = [
    (["capture_cpu.json"], capture),
    (["train_step_cpu_smollm2_512.json", "train_step_cpu_smollm2_1024.json", "train_step_cpu_smollm2_2048.json"], train_step),
    (["train_cpu_dtype.json"], train_dtype),
    (["train_cpu_memory.json"], train_memory),
    (["eval_workers_cpu.json"], eval_workers),
    (["online.json"], online),
    (["sglang_live.json"], sglang),
    (["verification_cpu.json"], verification),
    (["vllm_agreement_t1_quick.json"], vllm_t1),
    (["vllm_agreement_t1_quick_argmax.json"], vllm_t1),
    (["vllm_agreement_t1_demo.json"], lambda r: vllm_t1(r, draft="the full demo recipe's, arm l-ce of losses.json")),
    (["train_step_cuda_llama8b_2048.json", "train_step_cuda_llama8b_8192.json", "train_step_cuda_llama8b_32768.json",
      "train_step_cuda_llama8b_131072.json"], gpu_train_step),
    (["capture_gpu_llama8b.json"], capture_gpu),
]
FILES = [f for files, _ in ROWS for f in files]
NOT_MEASURED = [
    "| training step at T 65,536 on the H200; SpecForge past T 32,768 | **not measured** (the one-call GPU run's budget "
    "ran out before it) | — |",
]


def render(results: dict[str, dict]) -> str:
    lines = list(HEADER)
    for files, row in ROWS:
        what, result = row(*(results[f] for f in files))
        lines.append(f"| {what} | {result} | {', '.join(f'`bench/results/{f}`' for f in files)} |")
    return "\n".join(lines + NOT_MEASURED)
