"""docs/benchmarks.md: what exact verification costs on this CPU (bench/verification_cpu.py)."""

from __future__ import annotations

from _fmt import cpu

FILES = ["verification_cpu.json"]


def render(results: dict[str, dict]) -> str:
    r = results["verification_cpu.json"]
    f, d, v = r["forward_ms_median"], r["decoding"], r["verification"]
    flagged = [f"{x['example']} ({'x'.join(map(str, x['shape']))}, {x['modules']} modules)" for x in v["rowwise"]["linears"]]
    n = r["texts_compared"]
    return (
        f"Measured on {cpu(r)} (SmolLM2 bf16, {r['threads']} thread, medians of {f['reps']} paired runs; "
        f"`bench/results/verification_cpu.json`): the probe took {r['probe_cost_s']:.1f} s (first-call kernel set-up included) and found "
        f"{'these Linears batch-dependent: ' + ', '.join(flagged) if flagged else 'every Linear shape row-invariant'}; "
        f"the end-to-end verification was {'exact' if v['exact'] else '**not** exact'}. A 4-token verification forward "
        f"takes {f['probe']:.0f} ms with the probe's setting, {f['attention']:.0f} ms with row-wise attention only, "
        f"{f['all_linears']:.0f} ms with every Linear row-wise and {f['model']:.0f} ms with the model's own attention; a "
        f"one-token decode step {f['decode_1_row']:.0f} ms. Over {r['prompts']} MT-bench prompts × {r['max_new_tokens']} "
        f"tokens with a draft decoding at τ {d['probe']['tau']:.2f}: {d['probe']['tokens_per_s']:.1f} tok/s with the probe's setting vs "
        f"{d['plain']['tokens_per_s']:.1f} plain, output == plain greedy on {d['probe']['same_as_plain']} of {n} prompts; "
        f"with `--attention model` {d['model']['tokens_per_s']:.1f} tok/s, == plain on {d['model']['same_as_plain']} of {n}."
    )
