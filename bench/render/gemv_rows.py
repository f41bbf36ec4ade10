"""README *On a CPU*: the gemv kernel vs torch by verified rows (bench/gemv_rows.py)."""

from __future__ import annotations

from _fmt import cpu

FILES = ["gemv_rows_cpu.json"]


def render(results: dict[str, dict]) -> str:
    r = results["gemv_rows_cpu.json"]
    t = r["ms_per_forward"]
    # the file's torch_one_row_at_a_time arm is not rendered: its multi-row figures (slices of one input,
    # ~1 s for 2 rows vs ~0.1 s for 1) look like an oneDNN slow path of this benchmark's slicing, not yet explained
    cells = ", ".join(f"{M} row{'' if M == '1' else 's'} {x['kernel']:.0f} vs {x['torch_batched']:.0f}" for M, x in t.items())
    return (
        f"- The kernel's work grows with the rows it computes, torch's batched GEMM's hardly at these sizes: the "
        f"{r['linears']} linears of one SmolLM2 forward (its real bf16 weights, 1 thread, {cpu(r)}, median of "
        f"{r['reps']}) take, kernel vs torch batched in ms: {cells} (`bench/results/gemv_rows_cpu.json`). The kernel is "
        f"the faster up to {r['kernel_faster_than_torch_batched_up_to']} rows here, so `--linears auto` takes it for "
        f"verifications of at most {r['auto_max_rows']} rows (every chain the demo and the defaults verify); larger "
        f"trees keep torch's kernels (probed, row by row where batch-dependent), or `--linears kernel` forces it."
    )
