"""docs/benchmarks.md: τ at temperature 1, vLLM serving a draft (with eaglenest's CPU fix) vs our decoder
(bench/vllm_agreement.py)."""

from __future__ import annotations

from pathlib import Path

from _fmt import cpu, seq

FILES = ["vllm_agreement_t1_demo.json"]


def render(results: dict[str, dict]) -> str:
    r = results["vllm_agreement_t1_demo.json"]
    x = r["bf16"]
    fixed = "eaglenest's CPU fix applied" if any("replaced" in f for f in r["vllm_fixes"]) else "vLLM unpatched"
    return (f"τ at temperature {r['temperature']:g} with {r['draft_sampling']} drafts: vLLM {r['vllm_version']} "
            f"(`draft_sample_method: {r['vllm_speculative_config']['draft_sample_method']}`, {fixed}) vs our decoder, the "
            f"same draft (the demo recipe's, arm `{Path(r['draft']).parent.name}` of `bench/losses.py`), {x['prompts']} MT-bench prompts × "
            f"{r['max_new_tokens']} tokens, bf16, {cpu(r)} (`bench/results/vllm_agreement_t1_demo.json`): "
            f"**{x['tau_vllm']:.3f} vs {x['tau_ours']:.3f}** ({100 * x['relative_gap']:.1f} % apart); acceptance per "
            f"position {seq(x['accept_per_position_vllm'], 3)} vs {seq(x['accept_per_position_ours'], 3)}.")
