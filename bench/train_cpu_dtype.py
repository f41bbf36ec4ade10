"""The real trainer on a CPU, fp32 vs bf16 autocast, on real SmolLM2 features (issue 3's lever).

    python bench/train_cpu_dtype.py --features DEMO_OUT/features [--steps 40] [--dtypes fp32,bf16] [--accuracy-steps 150]

Each dtype runs in a fresh subprocess with the demo's recipe (TTT 3, draft vocabulary 8192,
1024-token batches, lr 1e-3) from the same seed: it times `--steps` optimizer steps of the first
epoch (the target's full-vocabulary argmax is computed), then the same micro-batches again (the
argmax comes from the per-batch cache, as in epochs >= 2), and records the training loss of every
step, so the two dtypes' losses can be compared step by step.  With --accuracy-steps N, a fresh run
of the same recipe trains N steps (`Trainer.fit`, schedule over N steps) and records its held-out
accuracy per TTT position, so the two dtypes' accuracy is compared on the same held-out samples.
Result: bench/results/train_cpu_dtype.json.
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


def child(features: str, dtype: str, steps: int, freeze_head: bool, accuracy_steps: int) -> dict:
    import tempfile

    from eaglenest.models.fetch import fetch
    from eaglenest.train.trainer import Trainer, TrainConfig

    def config(out: str, max_steps: int) -> TrainConfig:
        return TrainConfig(model=str(fetch("smollm2")), features=features, out=out, ttt_steps=3, draft_vocab=8192, lr=1e-3,
                           max_steps=max_steps, batch_tokens=1024, freeze_head=freeze_head, eval_fraction=0.05, dtype=dtype)

    res = {}
    with tempfile.TemporaryDirectory() as out:
        tr = Trainer(config(out, 10 * steps))
        from eaglenest.train.trainer import ARGMAX_CACHE_TOKENS

        tr.objective._argmax_room = ARGMAX_CACHE_TOKENS  # a run of several epochs caches; this short one replays epoch 1's batches

        def step(s: int) -> tuple[int, float]:
            loss_val, n, _, _ = tr.optimizer_step(tr.source.load(s))
            return n, loss_val

        step(0)  # warm-up: one-time kernel setup, not timed
        for phase in ("first_epoch", "argmax_cached"):
            t, n, losses = time.perf_counter(), 0, []
            for s in range(1, steps + 1):
                k, lv = step(s)
                n += k
                losses.append(round(lv, 5))
            el = time.perf_counter() - t
            res[phase] = {"tokens": n, "seconds": round(el, 2), "tokens_per_s": round(n / el, 1), "losses": losses}
    if accuracy_steps:
        with tempfile.TemporaryDirectory() as out:
            t = time.perf_counter()
            tr = Trainer(config(out, accuracy_steps))
            fit = tr.fit()
            res["accuracy_run"] = {"steps": fit["step"], "seconds": round(time.perf_counter() - t, 1),
                                   "heldout_acc": [round(x, 4) for x in fit["eval"]["acc"]],
                                   "heldout_batches": len(tr.eval_batches)}
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--features", required=True)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--freeze-head", action="store_true")
    ap.add_argument("--accuracy-steps", type=int, default=0, help="also train N steps per dtype and compare held-out accuracy (0: skip)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print("RESULT " + json.dumps(child(a.features, a.child, a.steps, a.freeze_head, a.accuracy_steps)))
        return 0
    from common import child_result, write_result

    from eaglenest.utils import cpu_has_fast_bf16

    runs = {}
    for dt in a.dtypes.split(","):
        cmd = [sys.executable, __file__, "--features", a.features, "--steps", str(a.steps), "--child", dt,
               "--accuracy-steps", str(a.accuracy_steps)]
        if a.freeze_head:
            cmd.append("--freeze-head")
        runs[dt] = child_result(cmd)
        print(dt, {k: v.get("tokens_per_s") for k, v in runs[dt].items() if isinstance(v, dict)})
    result = {"kind": "train_cpu_dtype", "recipe": "TTT 3, draft vocab 8192, 1024-token batches, lr 1e-3, "
              + ("frozen head" if a.freeze_head else "trained head"), "steps_per_phase": a.steps,
              "cpu_has_fast_bf16": cpu_has_fast_bf16(), "features": a.features, "runs": runs}
    if "fp32" in runs and "bf16" in runs and "error" not in runs["fp32"] and "error" not in runs["bf16"]:
        f, b = runs["fp32"], runs["bf16"]
        result["bf16_speedup"] = {p: round(b[p]["tokens_per_s"] / f[p]["tokens_per_s"], 2) for p in ("first_epoch", "argmax_cached")}
        diffs = [abs(x - y) / abs(x) for x, y in zip(f["first_epoch"]["losses"], b["first_epoch"]["losses"])]
        result["loss_max_rel_diff_first_epoch"] = round(max(diffs), 4)
        if a.accuracy_steps:  # the same held-out samples (same store, seed and eval fraction) for both dtypes
            result["heldout_acc_after_steps"] = {"steps": a.accuracy_steps, "fp32": f["accuracy_run"]["heldout_acc"],
                                                 "bf16": b["accuracy_run"]["heldout_acc"]}
    write_result("train_cpu_dtype", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
