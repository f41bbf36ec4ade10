"""docs/benchmarks.md: the gemv kernel vs torch by verified rows (bench/gemv_rows.py), one paragraph per
CPU kind, keyed by the data: another kind's file (gemv_rows_cpu_*.json) renders with no code change."""

from __future__ import annotations

from _fmt import cpu

FILES = ["gemv_rows_cpu_*.json"]
# why the row count matters on each build: what torch's batched kernels do there
TORCH = {"avx2": ("On a CPU without bf16 instructions torch emulates bf16 matmuls, and its cost grows with the rows as "
                  "the kernel's does.", "The AVX2 build"),
         "avx512-bf16": ("On a CPU with bf16 dot products but no AMX tiles torch's batched GEMM grows slowly with the rows, "
                         "and the kernel's work grows with them.", "The AVX512-BF16 build"),
         "amx": ("On a CPU with AMX tiles torch's batched GEMM hardly grows with the rows, and the kernel's work does.",
                 "The AVX512-BF16 build")}


def paragraph(name: str, r: dict) -> str:
    t = r["ms_per_forward"]
    # the file's torch_one_row_at_a_time arm is not rendered: its multi-row figures (slices of one input,
    # ~1 s for 2 rows vs ~0.1 s for 1 on the AVX512-BF16 machine) look like an oneDNN slow path of this
    # benchmark's slicing, not yet explained
    cells = ", ".join(f"{M} row{'' if M == '1' else 's'} {x['kernel']:.0f} vs {x['torch_batched']:.0f}" for M, x in t.items())
    upto = r["kernel_faster_than_torch_batched_up_to"]
    faster = (f"the faster at every row count measured (up to {upto})" if upto == max(int(M) for M in t)
              else f"the faster up to {upto} rows here")
    # files written before the cpu_kind field are the AVX2 build's, where the CPU kind is the isa
    why, build = TORCH[r["cpu_kind"] if "cpu_kind" in r else r["isa"]]
    return (f"- {why} {build}: the {r['linears']} linears of one SmolLM2 forward (its real bf16 weights, 1 thread, "
            f"{cpu(r)}, median of {r['reps']}) take, kernel vs torch batched in ms: {cells} (`bench/results/{name}`). "
            f"The kernel is {faster}, so `--linears auto` takes it there for verifications of at most "
            f"{r['auto_max_rows']} rows.")


def render(results: dict[str, dict]) -> str:
    return "\n".join(paragraph(name, r) for name, r in results.items())
