"""Online vs offline training on this CPU: the demo's recipe, both arms in one run.

    nice -n 10 python bench/online.py [--samples 300] [--eval-limit 40] [--eval-max-new-tokens 96] [--order offline,online]

offline = `capture` (hf engine, bf16, to a feature store on disk) then `train --features`;
online  = `train --online --engine hf --capture-dtype bf16` (target and draft in one process, the
          states of each step captured while training; the second epoch captures again).
Both train with the demo's recipe (eaglenest/demo.py PRESETS["full"]: TTT 3, draft vocabulary
8,192, lr 1e-3, 1,024-token micro-batches, 2 epochs, 5 % held out, bf16 autocast where the CPU
has bf16 matrix instructions) on the same prepared data, shortened to --samples ShareGPT
conversations (the demo has 1,500) so that both arms fit in one session on a shared machine.
Each stage runs as its own process (`python -m eaglenest ...`), timed, its peak RSS read from the
kernel (os.wait4: ru_maxrss); the load average is recorded before and after each arm.  Each
arm's draft is exported and evaluated on the first --eval-limit MT-bench questions (greedy, chain
of 3, topk 1): tau per arm and a paired bootstrap interval of their difference over the prompts.
Result: bench/results/online.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


def run(argv: list[str], log: Path) -> dict:
    """`python -m eaglenest ARGV` in its own process: wall time and peak RSS (from the kernel)."""
    t = time.time()
    with open(log, "w") as f:
        p = subprocess.Popen([sys.executable, "-m", "eaglenest", *argv], stdout=f, stderr=subprocess.STDOUT,
                             env={**os.environ, "EAGLENEST_NO_PROGRESS": "1"})
        _, status, ru = os.wait4(p.pid, 0)
    wall = time.time() - t
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"`eaglenest {' '.join(argv)}` failed: see {log}\n" + log.read_text()[-3000:])
    return {"argv": argv, "wall_s": round(wall, 1), "peak_rss_mb": round(ru.ru_maxrss / 1024)}


def tau_interval(a: list[dict], b: list[dict], n: int = 2000, seed: int = 0) -> dict:
    """Paired bootstrap over prompts of tau(b) - tau(a) (tau = verified tokens / verify steps)."""
    assert [r["id"] for r in a] == [r["id"] for r in b]
    rng = random.Random(seed)
    idx = range(len(a))

    def tau(rs, pick):
        return sum(rs[i]["verified_tokens"] for i in pick) / sum(rs[i]["verify_steps"] for i in pick)

    diffs = sorted(tau(b, p) - tau(a, p) for p in ([rng.choice(idx) for _ in idx] for _ in range(n)))
    return {"diff": tau(b, idx) - tau(a, idx), "ci95": [diffs[int(0.025 * n)], diffs[int(0.975 * n)]], "bootstrap": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=300, help="ShareGPT conversations (the demo: 1,500)")
    ap.add_argument("--eval-limit", type=int, default=40, help="MT-bench questions for tau (the demo: 80)")
    ap.add_argument("--eval-max-new-tokens", type=int, default=96, help="(the demo: 128)")
    ap.add_argument("--order", default="offline,online", help="arms in this order")
    ap.add_argument("--work", default="bench-online-work", help="scratch directory (data, store, runs)")
    ap.add_argument("--name", default="online", help="result file name (bench/results/NAME.json)")
    a = ap.parse_args()

    from eaglenest.demo import PRESETS, _train_dtype
    from eaglenest.models.fetch import fetch

    P = PRESETS["full"]
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    model = str(fetch("smollm2"))
    data = work / "data"
    if not (data / "meta.json").exists():
        from eaglenest.data import prepare

        prepare(model=model, data=["sharegpt:"], out=data, max_length=P["max_length"], limit=a.samples)
    meta = json.loads((data / "meta.json").read_text())
    dtype = _train_dtype(P["dtype"], "cpu")
    recipe = ["--model", model, "--ttt-steps", str(P["ttt_steps"]), "--draft-vocab", str(P["draft_vocab"]), "--lr", str(P["lr"]),
              "--epochs", str(P["epochs"]), "--batch-tokens", str(P["batch_tokens"]), "--eval-fraction", "0.05",
              "--device", "cpu", "--dtype", dtype, "--overwrite"]

    arms: dict[str, dict] = {}
    for arm in a.order.split(","):
        d = work / arm
        d.mkdir(exist_ok=True)
        load0, t0 = os.getloadavg(), time.time()
        if arm == "offline":
            feats = d / "features"
            if feats.exists():
                import shutil

                shutil.rmtree(feats)
            stages = {"capture": run(["capture", "--model", model, "--data", str(data), "--out", str(feats), "--device", "cpu",
                                      "--dtype", "bf16"], d / "capture.log"),
                      "train": run(["train", "--features", str(feats), "--out", str(d / "run"), *recipe], d / "train.log")}
            disk = sum(f.stat().st_size for f in feats.rglob("*") if f.is_file())
        else:
            stages = {"train": run(["train", "--online", "--data", str(data), "--engine", "hf", "--capture-dtype", "bf16",
                                    "--out", str(d / "run"), *recipe], d / "train.log")}
            disk = 0
        wall = time.time() - t0
        load1 = os.getloadavg()
        metrics = [json.loads(x) for x in (d / "run" / "metrics.jsonl").read_text().splitlines()]
        cfg = json.loads((d / "run" / "config.json").read_text())
        run(["export", "--run", str(d / "run"), "--out", str(d / "draft"), "--model", model], d / "export.log")
        ev = run(["eval", "--model", model, "--draft", str(d / "draft"), "--out", str(d / "report.json"), "--bench", "mtbench",
                  "--limit", str(a.eval_limit), "--steps", "3", "--topk", "1", "--temperature", "0", "--max-new-tokens",
                  str(a.eval_max_new_tokens), "--device", "cpu", "--no-baseline", "--workers", "2"], d / "eval.log")
        rep = json.loads((d / "report.json").read_text())
        arms[arm] = {
            "wall_s": round(wall, 1), "stages": stages, "peak_rss_mb": max(s["peak_rss_mb"] for s in stages.values()),
            "feature_store_bytes": disk, "load_avg_before": load0, "load_avg_after": load1,
            "steps": len(metrics), "train_tokens": sum(r["tokens"] for r in metrics),
            "final_eval": {k: v for k, v in metrics[-1].items() if k.startswith("eval_")},
            "losses_first_last": [metrics[0]["loss"], metrics[-1]["loss"]], "online_memory": cfg.get("online", {}).get("memory"),
            "tau": rep["tau"], "accept_per_position": rep.get("accept_per_position"), "eval_wall_s": ev["wall_s"],
            "per_prompt": rep["per_prompt"],
        }
        print(arm, {k: v for k, v in arms[arm].items() if k not in ("per_prompt", "stages")}, flush=True)

    off, on = arms.get("offline"), arms.get("online")
    summary = {}
    if off and on:
        summary = {"wall_online_over_offline": round(on["wall_s"] / off["wall_s"], 3),
                   "peak_rss_mb": {"offline": off["peak_rss_mb"], "online": on["peak_rss_mb"]},
                   "tau": {"offline": off["tau"], "online": on["tau"], "online_minus_offline": tau_interval(off["per_prompt"], on["per_prompt"])},
                   "feature_store_bytes_offline": off["feature_store_bytes"]}
    for arm in arms.values():
        arm["per_prompt"] = [{k: r[k] for k in ("id", "tau", "verified_tokens", "verify_steps")} for r in arm["per_prompt"]]
    from common import write_result

    write_result(a.name, {
        "kind": "online_vs_offline",
        "recipe": {"preset": "demo full, shortened", "samples": a.samples, "demo_samples": P["samples"],
                   "prepared_tokens": meta.get("n_tokens"), "max_length": P["max_length"], "ttt_steps": P["ttt_steps"],
                   "draft_vocab": P["draft_vocab"], "lr": P["lr"], "epochs": P["epochs"], "batch_tokens": P["batch_tokens"],
                   "train_dtype": dtype, "capture_dtype": "bf16", "eval": {"bench": "mtbench", "limit": a.eval_limit,
                   "max_new_tokens": a.eval_max_new_tokens, "steps": 3, "topk": 1, "temperature": 0}},
        "order": a.order.split(","), "note": "shared machine (up to 5 engineers on 2 cores): absolute times and the load vary; "
        "both arms ran back to back in this run, niced, with the load average recorded before and after each",
        "arms": arms, "summary": summary,
    })


if __name__ == "__main__":
    main()
