"""Sentences shared by the render modules of the gemv kernel's two builds (gemv_rows*, eval_gemv*)."""

from __future__ import annotations

from _fmt import cpu, seq


def describe(r: dict, name: str, build: str) -> str:
    t = r["ms_per_forward"]
    # the file's torch_one_row_at_a_time arm is not rendered: its multi-row figures (slices of one input,
    # ~1 s for 2 rows vs ~0.1 s for 1 on the AVX512-BF16 machine) look like an oneDNN slow path of this
    # benchmark's slicing, not yet explained
    cells = ", ".join(f"{M} row{'' if M == '1' else 's'} {x['kernel']:.0f} vs {x['torch_batched']:.0f}" for M, x in t.items())
    measured = max(int(M) for M in t)
    upto = r["kernel_faster_than_torch_batched_up_to"]
    faster = (f"the faster at every row count measured (up to {upto})" if upto == measured
              else f"the faster up to {upto} rows here")
    return (
        f"{build}: the {r['linears']} linears of one SmolLM2 forward (its real bf16 weights, 1 thread, {cpu(r)}, median of "
        f"{r['reps']}) take, kernel vs torch batched in ms: {cells} (`bench/results/{name}`). The kernel is {faster}, so "
        f"`--linears auto` takes it there for verifications of at most {r['auto_max_rows']} rows"
    )


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

