"""README *On a CPU*: the eval's linears in eaglenest's gemv kernel vs torch (bench/eval_gemv.py)."""

from __future__ import annotations

from _fmt import cpu, seq

FILES = ["eval_gemv_cpu.json"]


def render(results: dict[str, dict]) -> str:
    r = results["eval_gemv_cpu.json"]
    rounds = [x for x in r["rounds"] if "error" not in x["torch"] and "error" not in x["kernel"]]
    mean = lambda arm, k: sum(x[arm][k] for x in rounds) / len(rounds)  # noqa: E731
    exact = all(x[a]["greedy_matches_baseline"] and x[a]["verification_exact"] for x in rounds for a in ("torch", "kernel"))
    taus = f"τ {mean('torch', 'tau'):.3f} vs {mean('kernel', 'tau'):.3f}"
    return (
        f"- `eval --linears kernel` (`auto` picks it on an x86-64 CPU with AVX512-BF16, or else AVX2 + FMA, and a C "
        f"compiler) computes the bf16 Linear layers of decoding and verification forwards in eaglenest's own "
        f"matrix-vector kernel (`eaglenest/evaluate/gemv.py`, one source built for either instruction set): each output "
        f"is one fixed sequence of instructions, so a k-row "
        f"verification row is bit-identical to a one-row decode by construction, and it streams the weights faster "
        f"than torch's bf16 `F.linear` does for one row. The demo's eval stage ({r['prompts']} MT-bench first turns, "
        f"plain decoding of each too, 2 processes on 2 cores, {cpu(r)}, {len(rounds)} alternating rounds): the whole "
        f"eval takes {seq(r['kernel_over_torch_eval_s'])} of torch's time (round by round; "
        f"{mean('kernel', 'eval_elapsed_s'):.0f} vs {mean('torch', 'eval_elapsed_s'):.0f} s on average, model loads "
        f"included); speculative decoding {seq(r['kernel_over_torch_spec_tokens_per_s'])}x and plain decoding "
        f"{seq(r['kernel_over_torch_baseline_tokens_per_s'])}x torch's tokens/s; {taus}; greedy output == plain greedy "
        f"and verification exact in {'every' if exact else '**not every**'} run of both arms. The two kernels round "
        f"differently, so the texts agree on {r['texts_identical']} of {r['texts_compared']} prompts "
        f"(`bench/results/eval_gemv_cpu.json`)."
    )
