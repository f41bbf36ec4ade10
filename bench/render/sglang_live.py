"""docs/benchmarks.md: SGLang's CPU engine captured through eaglenest's plugin vs the hf engine (bench/sglang_live.py)."""

from __future__ import annotations

from _fmt import cpu, num

FILES = ["sglang_live.json"]


def render(results: dict[str, dict]) -> str:
    r = results["sglang_live.json"]
    g, c = r["greedy"], r["min_token_cosine"]
    return (f"SGLang's CPU engine (torch-native, started by `--sglang-serve`, eaglenest's capture plugin) vs the hf engine, "
            f"SmolLM2 {r['dtype']}, {r['samples']} ShareGPT samples, {cpu(r)} (`bench/results/sglang_live.json`): per-token "
            f"cosine at least **{c['aux_layers']}** (aux layers) and **{c['final_state']}** (final state), "
            f"{len(r['failures'])} failures; greedy text identical on {g['equal']} of {g['texts_compared']} prompts "
            f"({g['prompt_tokens']} prompt tokens, {g['max_new_tokens']} new); the server answered "
            f"{r['server_start_to_first_answer_s']:.0f} s after its start; capture {num(r['capture_tokens_per_s']['sglang_plugin'])} "
            f"vs {num(r['capture_tokens_per_s']['hf'])} tok/s.")
