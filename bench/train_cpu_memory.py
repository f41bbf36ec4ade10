"""Host memory of a CPU training run: oneDNN's kernel cache and glibc's heap, before and after.

    python bench/train_cpu_memory.py --features DEMO_OUT/features [--steps 300]

Runs the real `Trainer.fit` (the demo's recipe, bf16) twice in fresh subprocesses:
  before: ONEDNN_PRIMITIVE_CACHE_CAPACITY=1024 (oneDNN's default) and no heap trims;
  after:  eaglenest's defaults (a 64-kernel cache, malloc_trim every TRIM_EVERY steps).
A thread samples the process's anonymous RSS (/proc/self/status RssAnon: the private memory;
the memory-mapped feature store is file-backed and reclaimable) every 2 s.
Result: bench/results/train_cpu_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


def _anon_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child(features: str, steps: int, mode: str) -> dict:
    import tempfile
    import threading
    import time

    import torch

    import eaglenest.train.trainer as T
    from eaglenest.models.fetch import fetch

    if mode == "before":
        T.TRIM_EVERY = 10**12
    torch.set_num_threads(2)
    samples, stop = [], threading.Event()

    def sample():
        t0 = time.time()
        while not stop.wait(2.0):
            samples.append((round(time.time() - t0, 1), round(_anon_mb())))

    with tempfile.TemporaryDirectory() as out:
        cfg = T.TrainConfig(model=str(fetch("smollm2")), features=features, out=out, ttt_steps=3, draft_vocab=8192, lr=1e-3,
                            max_steps=steps, batch_tokens=1024, eval_fraction=0.05, dtype="bf16")
        tr = T.Trainer(cfg)
        th = threading.Thread(target=sample, daemon=True)
        th.start()
        t = time.time()
        tr.fit()
        wall = time.time() - t
        stop.set()
        th.join()
        rows = [json.loads(line) for line in open(Path(out) / "metrics.jsonl")]
    return {"mode": mode, "onednn_cache": os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY"), "trim_every": T.TRIM_EVERY,
            "steps": steps, "wall_s": round(wall, 1), "tokens_per_s": round(rows[-1]["tokens_per_s"], 1),
            "rss_anon_mb_peak": max(m for _, m in samples), "rss_anon_mb_end": samples[-1][1], "rss_anon_mb_samples": samples[::5]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--features", required=True)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--child", choices=["before", "after"])
    a = ap.parse_args()
    if a.child:
        print("RESULT " + json.dumps(child(a.features, a.steps, a.child)))
        return
    from common import write_result

    runs = []
    for mode in ("before", "after"):
        env = dict(os.environ)
        env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = "1024" if mode == "before" else env.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
        out = subprocess.run([sys.executable, __file__, "--features", a.features, "--steps", str(a.steps), "--child", mode],
                             env=env, capture_output=True, text=True, check=True).stdout
        runs.append(json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:]))
        print({k: v for k, v in runs[-1].items() if k != "rss_anon_mb_samples"})
    write_result("train_cpu_memory", {"kind": "train_cpu_memory", "features": a.features, "runs": runs})


if __name__ == "__main__":
    main()
