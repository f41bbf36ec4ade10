"""README *On a CPU*: the gemv kernel vs torch by verified rows (bench/gemv_rows.py), per build of the
kernel (gemv_rows_avx2.py renders the AVX2 build's file with `describe`)."""

from __future__ import annotations

from _fmt import cpu

FILES = ["gemv_rows_cpu.json"]


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


def render(results: dict[str, dict]) -> str:
    r = results["gemv_rows_cpu.json"]
    return (
        f"- The kernel's work grows with the rows it computes, torch's batched GEMM's hardly at these sizes (where the "
        f"CPU has bf16 matrix instructions). {describe(r, 'gemv_rows_cpu.json', 'Its AVX512-BF16 build')} (every chain "
        f"the demo and the defaults verify); larger trees keep torch's kernels (probed, row by row where batch-dependent), "
        f"or `--linears kernel` forces it."
    )
