"""The linears of one SmolLM2 forward (its real bf16 weights: 30 layers x 7 + the head) for M rows,
in eaglenest's gemv kernel vs torch's F.linear batched vs torch one row at a time (row slices of the
M-row input; the row-wise fallback (evaluate/rowwise/linears.py) slices a reshaped copy, with other strides), one thread
(an eval worker's setting).

    python bench/gemv_rows.py [--rows 1,2,4,8,12,16,32,64] [--reps 5]

Per M, the arms alternate within each repetition; the median over repetitions is recorded (ms for
all 211 linears of one forward).  Where the kernel stops paying against torch's batched kernel is
what `--linears auto` uses (rowwise.linears.GEMV_AUTO_MAX_ROWS, per CPU kind: torch's batched kernels
differ most between them).  Result: bench/results/gemv_rows_cpu_<cpu kind>.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,12,16,32,64")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--one-by-one-max", type=int, default=16, help="time the row-at-a-time arm up to this M")
    a = ap.parse_args()
    import torch
    import torch.nn.functional as F

    from common import write_result
    from eaglenest.evaluate.rowwise.linears import auto_max_rows
    from eaglenest.models.fetch import fetch
    from eaglenest.models.target import load_target
    from eaglenest.native import gemv
    from eaglenest.utils import cpu_kind

    torch.set_num_threads(1)
    lib, why = gemv.load()
    if lib is None:
        print(f"the gemv kernel cannot run here: {why}", file=sys.stderr)
        return 1
    model = load_target(fetch("smollm2"), "bf16", "cpu")
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    g = torch.Generator().manual_seed(0)

    def forward(fn, M: int) -> float:
        xs = {k: torch.randn(1, M, k, generator=g).bfloat16() for k in {w.shape[1] for w in weights}}
        t = time.perf_counter()
        with torch.inference_mode():
            for w in weights:
                fn(xs[w.shape[1]], w)
        return (time.perf_counter() - t) * 1000

    def one_by_one(x, w):
        return torch.cat([F.linear(x[:, i : i + 1], w) for i in range(x.shape[1])], 1)

    arms = {"kernel": gemv.linear, "torch_batched": F.linear, "torch_one_row_at_a_time": one_by_one}
    rows = [int(r) for r in a.rows.split(",")]
    for fn in arms.values():  # warm-up: first calls build kernels
        forward(fn, 4)
    table = {}
    for M in rows:
        names = [n for n in arms if n != "torch_one_row_at_a_time" or M <= a.one_by_one_max]
        times = {n: [] for n in names}
        for rep in range(a.reps):
            for n in (names if rep % 2 == 0 else names[::-1]):
                times[n].append(forward(arms[n], M))
        table[str(M)] = {n: round(statistics.median(v), 2) for n, v in times.items()}
        print(M, table[str(M)], flush=True)
    faster = [int(M) for M, t in table.items() if t["kernel"] < t["torch_batched"]]
    write_result(f"gemv_rows_cpu_{cpu_kind()}", {
        "isa": gemv.isa(), "cpu_kind": cpu_kind(),
        "what": "ms for the 211 bf16 linears of one SmolLM2 forward with M rows, 1 thread: gemv kernel vs torch",
        "linears": len(weights), "weight_bytes": sum(w.numel() * w.element_size() for w in weights), "reps": a.reps,
        "ms_per_forward": table,
        "kernel_faster_than_torch_batched_up_to": max((M for M in faster if all(m in faster for m in rows if m <= M)), default=0),
        "auto_max_rows": auto_max_rows(),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
