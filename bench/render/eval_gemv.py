"""docs/benchmarks.md: the eval's linears in eaglenest's gemv kernel vs torch (bench/eval_gemv.py)."""

from __future__ import annotations

from _fmt import cpu, seq

FILES = ["eval_gemv_cpu.json"]


def measured(r: dict, name: str, draft: str) -> str:
    rounds = [x for x in r["rounds"] if "error" not in x["torch"] and "error" not in x["kernel"]]
    mean = lambda arm, k: sum(x[arm][k] for x in rounds) / len(rounds)  # noqa: E731
    exact = all(x[a]["greedy_matches_baseline"] and x[a]["verification_exact"] for x in rounds for a in ("torch", "kernel"))
    return (
        f"The demo's eval stage ({r['prompts']} MT-bench first turns, plain decoding of each too, 2 processes on 2 cores, "
        f"{cpu(r)}, {len(rounds)} alternating rounds, {draft}): the whole eval takes {seq(r['kernel_over_torch_eval_s'])} "
        f"of torch's time (round by round; {mean('kernel', 'eval_elapsed_s'):.0f} vs {mean('torch', 'eval_elapsed_s'):.0f} "
        f"s on average, model loads included); speculative decoding {seq(r['kernel_over_torch_spec_tokens_per_s'])}x and "
        f"plain decoding {seq(r['kernel_over_torch_baseline_tokens_per_s'])}x torch's tokens/s; τ "
        f"{mean('torch', 'tau'):.3f} vs {mean('kernel', 'tau'):.3f}; greedy output == plain greedy and verification exact "
        f"in {'every' if exact else '**not every**'} run of both arms. The two kernels round differently, so the texts "
        f"agree on {r['texts_identical']} of {r['texts_compared']} prompts (`bench/results/{name}`)."
    )


def render(results: dict[str, dict]) -> str:
    r = results["eval_gemv_cpu.json"]
    return (
        f"- `eval --linears kernel` (`auto` picks it on an x86-64 CPU with AVX512-BF16, or else AVX2 + FMA, and a C "
        f"compiler) computes the bf16 Linear layers of decoding and verification forwards in eaglenest's own "
        f"matrix-vector kernel (`eaglenest/native/gemv.py`, one source built for either instruction set): each output "
        f"is one fixed sequence of instructions, so a k-row verification row is bit-identical to a one-row decode by "
        f"construction, and it streams the weights faster than torch's bf16 `F.linear` does for one row. "
        + measured(r, "eval_gemv_cpu.json", "the full demo's draft")
    )
