"""README *Results*: one row per headline measurement, each from its result files (the full blocks are in
docs/benchmarks.md).  A row: a function of the parsed files returning (what, result, what it covers)."""

from __future__ import annotations

from _fmt import cpu


def tau(r):
    ce = r["arms"]["l-ce"]["decoded"]
    d = r["decode"]
    return ("Acceptance length τ of a draft trained with `eaglenest demo`'s recipe on SmolLM2-135M",
            f"**{ce['t0']['tau']:.3f}** at temperature 0, **{ce['t1']['tau']:.3f}** at 1",
            f"all {d['prompts']} MT-bench first turns, {d['max_new_tokens']} new tokens, chain of {d['steps']}, our decoder, {cpu(r)}")


def vllm(r):
    x = r["bf16"]
    return (f"The same draft served by vLLM {r['vllm_version'].split('-')[1]} vs our decoder, temperature {r['temperature']:g}",
            f"τ {x['tau_vllm']:.3f} vs {x['tau_ours']:.3f} ({100 * x['relative_gap']:.1f} % apart)",
            f"{x['prompts']} MT-bench prompts × {r['max_new_tokens']} tokens, bf16, {cpu(r)}")


def sglang(r):
    c, g = r["min_token_cosine"], r["greedy"]
    return ("SGLang's CPU engine with eaglenest's capture plugin vs the hf engine",
            f"per-token cosine at least {c['aux_layers']}; greedy text identical on {g['equal']} of {g['texts_compared']}",
            f"SmolLM2 {r['dtype']}, {r['samples']} ShareGPT samples")


def fp8(d):
    v = d["variants"]
    return ("fp8 feature store (one scale per block of at most 128 values) vs bf16",
            f"{v['fp8']['bytes_on_disk_per_token'] / v['bf16']['bytes_on_disk_per_token']:.2f}x the bytes on disk",
            "SmolLM2; what it costs in τ: `docs/benchmarks.md`, *Retired probes* (`store_outliers`)")


def train_ab(*rs):
    each = [(r["cpu_kind"], r["summary"]) for r in rs]
    return ("CPU training step vs the trainer before row compaction, the fused head + loss and bf16 parameters",
            "; ".join(f"{k} ({r['arms']['new']['commit'][:7]}): **{s['speedup_median']:.2f}x**, peak RSS {s['peak_rss_gib']['new']:.2f} vs "
                      f"{s['peak_rss_gib']['base']:.2f} GiB, losses {'within' if s['losses_equal_within_tolerance'] else 'outside'} "
                      "the tolerance" for r, (k, s) in zip(rs, each))
            + f"; held-out accuracy at most {max(s['eval_acc_max_abs_diff'] for _, s in each):.3f} apart",
            f"the demo recipe, {rs[0]['steps']} steps, " + ", ".join(f"{cpu(r)} ({r['cpu_kind']}; {r['rounds']} paired rounds)" for r in rs))


def regen(r):
    a = r["arms"]
    vs = lambda k: f"{a[k]['tau_vs_original']['delta']:+.3f} ({a[k]['tau_vs_original']['ci95'][0]:+.3f} … {a[k]['tau_vs_original']['ci95'][1]:+.3f})"  # noqa: E731
    return ("A draft trained on the target's own answers (`regenerate`, looping answers left out) vs the data's",
            f"τ {a['greedy']['eval']['tau']:.3f} (greedy answers), {a['sampled']['eval']['tau']:.3f} (sampled at {r['temperature']:g}) vs "
            f"{a['original']['eval']['tau']:.3f}; paired difference {vs('greedy')} and {vs('sampled')}",
            f"EAGLE-3, the demo recipe for {r['steps']} steps on one slice of {a['original']['data']['samples']} ShareGPT conversations, "
            f"all {r['prompts']} MT-bench first turns, {cpu(r)}")


ROWS = [
    (["losses.json"], tau),
    (["vllm_agreement_t1_demo.json"], vllm),
    (["sglang_live.json"], sglang),
    (["store_dtype.json"], fp8),
    (["train_step_ab_demo_amx.json", "train_step_ab_demo_avx512-bf16.json"], train_ab),
    (["regen_recipe.json"], regen),
]
FILES = [f for files, _ in ROWS for f in files]


def render(results: dict[str, dict]) -> str:
    lines = ["| measured | result | covers | file |", "|---|---|---|---|"]
    for files, row in ROWS:
        what, result, covers = row(*(results[f] for f in files))
        lines.append(f"| {what} | {result} | {covers} | {', '.join(f'`{f}`' for f in files)} |")
    return "\n".join(lines)
