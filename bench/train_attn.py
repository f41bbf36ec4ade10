"""The TTT attention kernels on a CPU: the real trainer, the demo's recipe, the demo's features.

    python bench/train_attn.py --features DEMO_OUT/features [--steps 30] [--impls eager,sdpa] [--rounds 2]

Each kernel (`--attn-impl`) runs in a fresh subprocess with the demo's recipe (TTT 3, draft
vocabulary 8192, 1024-token batches, lr 1e-3, bf16 autocast where the CPU has bf16 matrix
instructions, else fp32) from the same seed over the same micro-batches: one warm-up step, then
`--steps` timed optimizer steps of the first epoch.  The kernels alternate, A B A B over `--rounds`,
so a machine whose speed drifts (these do, by tens of percent within an hour) affects both alike;
each round's pair is reported, and the losses of every step are kept, so that the kernels' losses
are compared step by step with the first one's.  Result: bench/results/train_attn_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


def child(features: str, impl: str, steps: int, dtype: str) -> dict:
    import tempfile

    from eaglenest.models.fetch import fetch
    from eaglenest.train.trainer import Trainer, TrainConfig

    with tempfile.TemporaryDirectory() as out:
        tr = Trainer(TrainConfig(model=str(fetch("smollm2")), features=features, out=out, ttt_steps=3, draft_vocab=8192,
                                 lr=1e-3, max_steps=10 * steps, batch_tokens=1024, eval_fraction=0.05, dtype=dtype,
                                 device="cpu", attn_impl=impl))
        losses, n = [], 0
        tr.optimizer_step(tr.source.load(0))  # warm-up: one-time kernel setup, not timed
        t = time.perf_counter()
        for s in range(1, steps + 1):
            loss_val, k, _, _ = tr.optimizer_step(tr.source.load(s))
            n += k
            losses.append(round(loss_val, 5))
        el = time.perf_counter() - t
        return {"attn_impl": tr.attn_impl, "tokens": n, "seconds": round(el, 2), "tokens_per_s": round(n / el, 1),
                "seconds_per_step": round(el / steps, 4), "losses": losses}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--features", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--impls", default="eager,sdpa", help="comma list; the first is the reference of the loss comparison")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print("RESULT " + json.dumps(child(a.features, a.child, a.steps, a.dtype)))
        return 0
    from common import child_result, write_result

    from eaglenest.utils import cpu_has_fast_bf16

    dtype = "bf16" if cpu_has_fast_bf16() else "fp32"  # what `eaglenest demo` trains in on this CPU
    impls = a.impls.split(",")
    rounds = []
    for r in range(a.rounds):
        runs = {}
        for impl in impls:
            runs[impl] = child_result([sys.executable, __file__, "--features", a.features, "--steps", str(a.steps), "--child",
                                       impl, "--dtype", dtype])
            if "error" in runs[impl]:
                raise SystemExit(f"{impl} failed:\n{runs[impl]['error']}")
            print(f"round {r + 1} {impl}: {runs[impl]['seconds_per_step']} s/step", flush=True)
        rounds.append(runs)
    ref = impls[0]
    summary = {}
    for impl in impls:
        per_round = [x[impl]["seconds_per_step"] for x in rounds]
        summary[impl] = {"seconds_per_step": per_round, "mean_seconds_per_step": round(sum(per_round) / len(per_round), 4),
                         "step_time_vs_ref_per_round": [round(x[impl]["seconds_per_step"] / x[ref]["seconds_per_step"], 3)
                                                        for x in rounds],
                         "loss_max_rel_diff_vs_ref": round(max(abs(p - q) / abs(q) for p, q in
                                                               zip(rounds[0][impl]["losses"], rounds[0][ref]["losses"])), 5)}
    write_result("train_attn_cpu", {
        "kind": "train_attn_cpu", "recipe": f"demo: TTT 3, draft vocab 8192, 1024-token batches, lr 1e-3, {dtype}",
        "steps_timed": a.steps, "reference": ref, "features": a.features, "summary": summary, "rounds": rounds})
    return 0


if __name__ == "__main__":
    sys.exit(main())
