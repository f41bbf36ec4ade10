"""`eaglenest eval --workers N` on a CPU: wall time of the same evaluation in 1 and N processes.

    python bench/eval_workers.py --draft DEMO_OUT/draft [--limit 24] [--max-new-tokens 128] [--workers 1,2]

Batch-1 decoding of a small target is bound by per-op latency, not by the cores: one process with
2 threads leaves the cores half idle.  Each setting runs the real `eaglenest eval` (MT-bench first
turns, 3 steps, topk 1, greedy, plain-decoding baseline on every prompt) on the same draft; the
per-prompt outputs must be identical across settings (recorded as `same_outputs`).
Result: bench/results/eval_workers_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--limit", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--workers", default="1,2")
    a = ap.parse_args()
    from common import write_result

    runs, outputs = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for w in a.workers.split(","):
            out = Path(tmp) / f"w{w}.json"
            cmd = [sys.executable, "-m", "eaglenest", "eval", "--model", "smollm2", "--draft", a.draft, "--out", str(out),
                   "--limit", str(a.limit), "--max-new-tokens", str(a.max_new_tokens), "--device", "cpu", "--workers", w]
            t = time.perf_counter()
            p = subprocess.run(cmd, capture_output=True, text=True, env={**__import__("os").environ, "EAGLENEST_NO_PROGRESS": "1"})
            wall = time.perf_counter() - t
            if p.returncode != 0:
                runs[w] = {"error": p.stderr[-2000:]}
                continue
            r = json.loads(out.read_text())
            runs[w] = {"wall_s": round(wall, 1), "eval_elapsed_s": r["elapsed_s"], "tau": r["tau"],
                       "spec_tokens_per_s_per_process": round(r["spec_tokens_per_s"], 2),
                       "baseline_tokens_per_s_per_process": round(r["baseline_tokens_per_s"], 2),
                       "greedy_matches_baseline": r["greedy_matches_baseline"], "baseline_prompts": r["baseline_prompts"],
                       "texts_compared": r["texts_compared"], "generated_tokens": r["generated_tokens"]}
            outputs[w] = [p["output_ids"] for p in r["per_prompt"]]
            print(w, runs[w])
    ws = list(outputs)
    result = {"kind": "eval_workers_cpu", "draft": a.draft, "limit": a.limit, "max_new_tokens": a.max_new_tokens, "runs": runs,
              # the speculative outputs of every setting compared with the first one's, generation by generation
              "same_outputs": all(outputs[w] == outputs[ws[0]] for w in ws) if ws else None,
              "outputs_compared": min(len(o) for o in outputs.values()) if ws else 0}
    if "1" in runs and len(ws) > 1 and "error" not in runs["1"]:
        # the whole `eval` (model loads in each process included), not a per-process decode rate
        result["speedup_vs_1"] = {w: round(runs["1"]["eval_elapsed_s"] / runs[w]["eval_elapsed_s"], 2) for w in ws if w != "1"}
    write_result("eval_workers_cpu", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
