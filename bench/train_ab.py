"""Paired A/B of the trainer: this tree's vs an earlier revision's, on the same features.

    python bench/train_ab.py --features FEAT [--base-rev bdb2a05] [--steps 20] [--dtype fp32] [--mode steps|loop]

--mode steps (default; bench/results/train_ab.json): ONE process holds both trainers (the old
revision imported as `eaglenest_old`) and alternates them step by step, old step s then new
step s, timing each (the new one's time includes reading its micro-batches, i.e. no prefetch:
its worst case); on a shared machine only such fine-grained pairs see the same load.

--mode loop (bench/results/train_ab_loop.json): each round runs `Trainer(TrainConfig(...)).fit()` of both revisions in fresh subprocesses, in
alternating order (the machine's load drifts; pairs share it), with the demo's recipe (TTT 3,
draft vocabulary 8192, 1024-token batches, lr 1e-3) for `--steps` optimizer steps.  Recorded per
run: the loop's tokens/s (metrics.jsonl's last `tokens_per_s`: reading, teacher, draft,
optimizer), fit()'s wall time, the 1-minute load average, and every step's loss, which must be
identical between the revisions (the refactor changes no arithmetic).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def child(features: str, steps: int, dtype: str) -> dict:
    import time

    import eaglenest
    from eaglenest.models.fetch import fetch
    from eaglenest.train.trainer import TrainConfig, Trainer

    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(model=str(fetch("smollm2")), features=features, out=out, ttt_steps=3, draft_vocab=8192, lr=1e-3,
                          max_steps=steps, batch_tokens=1024, eval_fraction=0.05, eval_every=10 * steps, dtype=dtype)
        t0 = time.perf_counter()
        tr = Trainer(cfg)
        t1 = time.perf_counter()
        tr.fit()
        t2 = time.perf_counter()
        rows = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return {"eaglenest": str(Path(eaglenest.__file__).parent), "setup_s": round(t1 - t0, 2), "fit_s": round(t2 - t1, 2), "tokens": sum(r["tokens"] for r in rows),
            "tokens_per_s": round(rows[-1]["tokens_per_s"], 1), "losses": [r["loss"] for r in rows],
            "data_wait_s": [r.get("data_wait_s") for r in rows], "loadavg_1m_after": round(os.getloadavg()[0], 2)}


def old_package(rev: str) -> Path:
    """The old revision's eaglenest as an importable `eaglenest_old` package (in a temp dir)."""
    import re

    base = Path(tempfile.mkdtemp(prefix="eaglenest-old-"))
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "eaglenest"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
    (base / "eaglenest").rename(base / "eaglenest_old")
    for f in (base / "eaglenest_old").rglob("*.py"):
        f.write_text(re.sub(r"\beaglenest(?=[. ])", "eaglenest_old", f.read_text()))
    return base


def interleaved(features: str, steps: int, dtype: str, rev: str) -> dict:
    import time

    import torch

    sys.path.insert(0, str(old_package(rev)))
    from eaglenest_old.train.trainer import Trainer as OldTrainer
    from eaglenest_old.train.trainer import TrainConfig as OldConfig

    from eaglenest.models.fetch import fetch
    from eaglenest.train.trainer import TrainConfig, Trainer

    kw = dict(model=str(fetch("smollm2")), features=features, ttt_steps=3, draft_vocab=8192, lr=1e-3, max_steps=10 * steps,
              batch_tokens=1024, eval_fraction=0.05, dtype=dtype)
    with tempfile.TemporaryDirectory() as o1, tempfile.TemporaryDirectory() as o2:
        old, new = OldTrainer(OldConfig(out=o1, **kw)), Trainer(TrainConfig(out=o2, **kw))
        res = {"old": {"seconds": [], "losses": [], "tokens": []}, "new": {"seconds": [], "losses": [], "tokens": []}, "loadavg_1m": []}
        for s in range(steps + 1):  # step 0: warm-up (one-time kernel set-up), not counted
            for name in (("old", "new") if s % 2 == 0 else ("new", "old")):
                t = time.perf_counter()
                if name == "old":
                    loss, n, _, _ = old.optimizer_step(old.schedule.step_batches(s)[1])  # reads inside
                else:
                    loss, n, _, _ = new.optimizer_step(new.source.load(s))  # read + step, no prefetch
                el = time.perf_counter() - t
                if s:
                    res[name]["seconds"].append(round(el, 3))
                    res[name]["tokens"].append(n)
                res[name]["losses"].append(loss)
            res["loadavg_1m"].append(round(os.getloadavg()[0], 2))
    for name in ("old", "new"):
        r = res[name]
        r["tokens_per_s"] = round(sum(r["tokens"]) / sum(r["seconds"]), 1)
    res["per_step_ratio_new_over_old"] = [round(o / n, 3) for o, n in zip(res["old"]["seconds"], res["new"]["seconds"])]
    res["median_step_ratio_new_over_old"] = round(statistics.median(res["per_step_ratio_new_over_old"]), 3)
    res["losses_identical"] = res["old"]["losses"] == res["new"]["losses"]
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--features", required=True)
    ap.add_argument("--base-rev", default="bdb2a05", help="git revision of the old trainer")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--mode", default="steps", choices=["steps", "loop"])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:  # PYTHONPATH alone decides which eaglenest this process imports
        print("RESULT " + json.dumps(child(a.features, a.steps, a.dtype)))
        return 0
    sys.path[:0] = [str(HERE), str(ROOT)]
    from common import child_result, write_result

    if a.mode == "steps":
        res = interleaved(a.features, a.steps, a.dtype, a.base_rev)
        rev_new = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        print({k: res[k] for k in ("median_step_ratio_new_over_old", "losses_identical")}, res["old"]["tokens_per_s"], res["new"]["tokens_per_s"])
        write_result("train_ab", {"kind": "train_ab", "mode": "steps interleaved in one process", "dtype": a.dtype, "steps": a.steps,
                                  "recipe": "TTT 3, draft vocab 8192, 1024-token batches, lr 1e-3, trained head",
                                  "revisions": {"old": a.base_rev, "new": rev_new}, "features": a.features, **res,
                                  "machine_shared": "yes: the 2-core machine ran other engineers' jobs (load 6-15); steps paired, load recorded"})
        return 0

    base = Path(tempfile.mkdtemp(prefix="eaglenest-base-"))
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", a.base_rev, "eaglenest"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
    rev_new = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    trees = {"old": str(base), "new": str(ROOT)}
    runs: dict[str, list] = {"old": [], "new": []}
    for r in range(a.rounds):
        for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
            env = {**os.environ, "PYTHONPATH": trees[name], "EAGLENEST_NO_PROGRESS": "1"}
            load = os.getloadavg()[0]
            cmd = [sys.executable, __file__, "--features", a.features, "--steps", str(a.steps), "--dtype", a.dtype, "--child"]
            res = child_result(cmd, env=env, cwd="/")
            res["loadavg_1m_before"] = round(load, 2)
            assert "error" in res or res["eaglenest"] == str(Path(trees[name]) / "eaglenest"), (name, res["eaglenest"])
            runs[name].append(res)
            print(name, r, {k: res.get(k) for k in ("tokens_per_s", "fit_s", "loadavg_1m_before", "error")}, flush=True)
    ok = all("error" not in x for v in runs.values() for x in v)
    result = {"kind": "train_ab", "what": "whole training loop (Trainer.fit), old vs new trainer, same features",
              "recipe": "TTT 3, draft vocab 8192, 1024-token batches, lr 1e-3, trained head", "dtype": a.dtype, "steps": a.steps,
              "revisions": {"old": a.base_rev, "new": rev_new}, "features": a.features, "runs": runs,
              "machine_shared": "yes: the 2-core machine was shared with other engineers' jobs; pairs interleaved, load recorded"}
    if ok:
        tps = {k: [x["tokens_per_s"] for x in v] for k, v in runs.items()}
        result["median_tokens_per_s"] = {k: statistics.median(v) for k, v in tps.items()}
        result["paired_ratio_new_over_old"] = [round(n / o, 3) for n, o in zip(tps["new"], tps["old"])]
        result["median_ratio_new_over_old"] = round(statistics.median(result["paired_ratio_new_over_old"]), 3)
        result["losses_identical"] = all(x["losses"] == runs["old"][0]["losses"] for v in runs.values() for x in v)
    write_result("train_ab_loop", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
