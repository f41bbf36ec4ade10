"""Peak tensor memory of the teacher + one loss step at Kimi-K2.5's vocabulary, before and after the
teacher's representation change (issue 24.5), counted on the meta device (nothing is allocated).

One loss step = `Teacher.targets` of N final states (bf16 matmuls, as under `--dtype auto` on CUDA)
and, chunk by chunk through the fused head + loss (losses.head_loss), the draft's logits
(hidden [c, H] @ lm_head [Vd, H]^T, bf16) through the loss, forward and backward.  The draft's layer
and the TTT loop are not part of it (they do not depend on the vocabulary).  The previous code is
`git show b841df4:eaglenest/train/ttt.py` at its CUDA chunk sizes (teacher 8192 rows, logits 4096).

    python bench/loss_memory.py            # -> bench/results/loss_memory.json
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

from eaglenest.train.losses import LossSpec, SoftTarget, chunk_rows, head_loss, loss_step_bytes  # noqa: E402
from eaglenest.train.memtrace import LiveTensorBytes  # noqa: E402
from eaglenest.train.ttt import TEACHER_CHUNK_ELEMS, Teacher  # noqa: E402

GiB = 1 << 30
PREVIOUS = "b841df4"  # main before the loss module: the fp32-probability teacher and SoftCrossEntropy


def inputs(N: int, V: int, Vd: int, H: int, device: str):
    bf = torch.bfloat16
    W = torch.empty(V, H, dtype=bf, device=device)
    rows = torch.arange(Vd, device=device)
    t2d = torch.zeros(V, dtype=torch.bool, device=device)
    t2d[:Vd] = True
    last = torch.empty(N, H, dtype=bf, device=device)
    head = torch.empty(Vd, H, dtype=bf, device=device, requires_grad=True)
    head.grad = torch.zeros_like(head)  # the accumulated gradient is model memory; each chunk's own [Vd, H] is the step's
    hidden = torch.empty(N, H, dtype=bf, device=device, requires_grad=True)
    w = torch.ones(N, device=device)
    if device != "meta":
        for t in (W, last, head, hidden):
            torch.nn.init.normal_(t.data, std=0.02)
    return W, rows, t2d, last, head, hidden, w


def new_step(N, V, Vd, H, device, spec: LossSpec, chunk: int | None = None) -> dict:
    W, rows, t2d, last, head, hidden, w = inputs(N, V, Vd, H, device)
    teacher = Teacher(None, 1e-6, W, rows, t2d, matmul_dtype=torch.bfloat16)
    teacher.heads()  # the draft-rows head (a copy unless the draft vocabulary is the whole one) is model memory, not the step's
    c = chunk or chunk_rows(4096, Vd)
    with LiveTensorBytes() as m:
        t = teacher.targets(last, mass=spec.needs_alpha)
        kept, teacher_peak = m.live, m.peak
        head_loss(hidden, head, SoftTarget(t, torch.arange(N, device=device), spec), w, c)[0].backward()
    return {"peak_bytes": m.peak, "teacher_peak_bytes": teacher_peak, "teacher_kept_bytes": kept, "largest_tensor": list(m.largest),
            "largest_by_dtype": {k: list(v) for k, v in m.largest_by_dtype.items()},
            "loss_chunk_rows": c, "teacher_chunk_rows": max(1, TEACHER_CHUNK_ELEMS // V)}


def old_step(N, V, Vd, H, device) -> dict:
    """The previous teacher (fp32 probabilities [N, Vd], 8192-row chunks of the full head on CUDA) and
    SoftCrossEntropy over 4096-row logits chunks."""
    from torch.utils.checkpoint import checkpoint

    src = subprocess.run(["git", "show", f"{PREVIOUS}:eaglenest/train/ttt.py"], cwd=HERE.parent, capture_output=True, text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "old_ttt.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("old_ttt", path)
    old = sys.modules["old_ttt"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    W, rows, t2d, last, head, hidden, w = inputs(N, V, Vd, H, device)
    teacher = old.Teacher(None, 1e-6, W, rows, t2d, matmul_dtype=torch.bfloat16)
    teacher.heads()
    with LiveTensorBytes() as m:
        probs, _ = teacher.targets(last, chunk=8192)
        kept, teacher_peak = m.live, m.peak
        for s in range(0, N, 4096):
            r = torch.arange(s, min(N, s + 4096), device=device)

            def f(hc, r=r):
                return old.SoftCrossEntropy.apply(hc @ head.T, probs, r, w[r])[0]

            checkpoint(f, hidden[s : s + 4096], use_reentrant=False).backward()
    return {"peak_bytes": m.peak, "teacher_peak_bytes": teacher_peak, "teacher_kept_bytes": kept, "largest_tensor": list(m.largest),
            "largest_by_dtype": {k: list(v) for k, v in m.largest_by_dtype.items()},
            "loss_chunk_rows": 4096, "teacher_chunk_rows": 8192}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    V = Vd = 163_840  # Kimi-K2.5: the published drafts keep the whole vocabulary
    H = 7168
    N = a.tokens
    cases = {}
    for name, spec in (("ce", LossSpec.parse("ce")), ("lk_hybrid", LossSpec.parse("lk_hybrid"))):
        r = new_step(N, V, Vd, H, "meta", spec)
        r["formula_bytes"] = loss_step_bytes(N, V, Vd, H, r["loss_chunk_rows"], r["teacher_chunk_rows"], spec.needs_alpha, spec.needs_alpha)
        cases[name] = r
    cases["previous_ce"] = old_step(N, V, Vd, H, "meta")
    # the same measurement on real CPU tensors at a reduced size: the meta count is the real one
    n, v, h = 1024, 16_384, 256
    cpu = new_step(n, v, v, h, "cpu", LossSpec.parse("lk_hybrid"), chunk=256)
    meta = new_step(n, v, v, h, "meta", LossSpec.parse("lk_hybrid"), chunk=256)
    for k, r in cases.items():
        print(f"{k:12s} peak {r['peak_bytes'] / GiB:6.2f} GiB  teacher kept {r['teacher_kept_bytes'] / GiB:5.2f} GiB  "
              f"largest {r['largest_tensor']}" + (f"  formula {r['formula_bytes'] / GiB:.2f} GiB" if "formula_bytes" in r else ""))
    print(f"reduced size, cpu vs meta peak: {cpu['peak_bytes']} vs {meta['peak_bytes']} bytes")
    result = {
        "what": "peak tensor bytes of Teacher.targets + one loss step (draft logits chunk by chunk, forward and backward), "
                "bf16 matmuls, counted op by op (eaglenest/train/memtrace.py) on the meta device",
        "shape": {"tokens": N, "vocab": V, "draft_vocab": Vd, "hidden": H, "dtype": "bf16"},
        "cases": cases,
        "cpu_vs_meta_reduced": {"shape": {"tokens": n, "vocab": v, "hidden": h, "loss_chunk_rows": 256},
                                "cpu_peak_bytes": cpu["peak_bytes"], "meta_peak_bytes": meta["peak_bytes"]},
    }
    if not a.no_write:
        from bench.common import write_result

        write_result("loss_memory", result)


if __name__ == "__main__":
    main()
