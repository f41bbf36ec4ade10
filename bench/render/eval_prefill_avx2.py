"""docs/benchmarks.md: the eval's prompt prefills in an fp32 GEMM vs torch's emulated bf16 GEMM on a CPU
without bf16 matrix instructions (bench/eval_prefill.py)."""

from __future__ import annotations

from _fmt import cpu, seq

FILES = ["eval_prefill_cpu_avx2.json"]


def render(results: dict[str, dict]) -> str:
    r = results["eval_prefill_cpu_avx2.json"]
    rounds = [x for x in r["rounds"] if "error" not in x["bf16"] and "error" not in x["fp32"]]
    mean = lambda arm, k: sum(x[arm][k] for x in rounds) / len(rounds)  # noqa: E731
    exact = all(x[a]["greedy_matches_baseline"] and x[a]["verification_exact"] for x in rounds for a in ("bf16", "fp32"))
    return (
        "- Prompt prefills (forwards longer than a verification, shared by plain and speculative decoding) stay in a "
        "GEMM; where the CPU has no bf16 matrix instructions torch emulates the bf16 one, so eval runs them as an fp32 "
        "GEMM of the same bf16 values there (`EAGLENEST_BF16_PREFILL=1` keeps torch's). The demo's eval stage "
        f"({r['prompts']} MT-bench first turns, plain decoding of each too, 2 processes on 2 cores, {cpu(r)}, "
        f"{len(rounds)} alternating rounds, the gemv kernel for decoding and verification in both arms, the quick "
        f"demo's draft): the whole eval takes {seq(r['fp32_over_bf16_eval_s'])} of the bf16 prefill's time (round by "
        f"round; {mean('fp32', 'eval_elapsed_s'):.0f} vs {mean('bf16', 'eval_elapsed_s'):.0f} s on average, model loads "
        f"included); speculative decoding {seq(r['fp32_over_bf16_spec_tokens_per_s'])}x and plain decoding "
        f"{seq(r['fp32_over_bf16_baseline_tokens_per_s'])}x the tokens/s (prefill included); τ "
        f"{mean('bf16', 'tau'):.3f} vs {mean('fp32', 'tau'):.3f}; greedy output == plain greedy and verification exact "
        f"in {'every' if exact else '**not every**'} run of both arms; the texts of the two arms agree on "
        f"{r['texts_identical']} of {r['texts_compared']} prompts (`bench/results/eval_prefill_cpu_avx2.json`)."
    )
