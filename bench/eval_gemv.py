"""The demo's eval stage with the target's linears in torch (`--linears torch`) and in eaglenest's
row-invariant gemv kernel (`--linears kernel`), alternating, on the same draft.

    python bench/eval_gemv.py --draft DEMO_OUT/draft [--limit 24] [--rounds 2]

Each arm is the demo's own `eaglenest eval` command (eaglenest.demo.eval_argv: MT-bench first turns,
3 steps, topk 1, greedy, 128 new tokens, 2 worker processes on 2 cores), with the plain-decoding
baseline on every one of the `--limit` prompts.  Recorded per arm: the whole eval's seconds (model
loads and probes included), decoded tokens/s per process (speculative and plain), tau, greedy ==
plain, and the verification block.  The two kernels round differently, so their greedy texts may
differ at near-ties: `texts_identical` counts the prompts whose outputs agree across arms.
Result: bench/results/eval_gemv_cpu.json (the kernel's AVX512-BF16 build) or eval_gemv_cpu_<isa>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

ARMS = ("torch", "kernel")


def run_arm(draft: str, limit: int, linears: str, out: Path, env: dict | None = None) -> tuple[dict, list]:
    from eaglenest.demo import PRESETS, eval_argv
    from eaglenest.models.fetch import fetch

    P = {**PRESETS["full"], "eval_limit": limit, "baseline_limit": limit}
    cmd = [sys.executable, "-m", "eaglenest", *eval_argv(P, str(fetch("smollm2")), draft, out, "cpu"), "--linears", linears]
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "EAGLENEST_NO_PROGRESS": "1", **(env or {})})
    wall = time.perf_counter() - t
    if p.returncode != 0:
        return {"error": p.stderr[-2000:]}, []
    r = json.loads(out.read_text())
    v = r["verification"]
    return {"wall_s": round(wall, 1), "eval_elapsed_s": r["elapsed_s"], "tau": r["tau"],
            "spec_tokens_per_s_per_process": round(r["spec_tokens_per_s"], 2),
            "baseline_tokens_per_s_per_process": round(r["baseline_tokens_per_s"], 2),
            "greedy_matches_baseline": r["greedy_matches_baseline"], "baseline_prompts": r["baseline_prompts"],
            "generated_tokens": r["generated_tokens"], "workers": r.get("workers"),
            "verification_exact": v["exact"], "linears": v.get("linears"),
            "cmd": " ".join(cmd[1:])}, [x["output_ids"] for x in r["per_prompt"]]


def alternate(draft: str, limit: int, n_rounds: int, arms: dict[str, tuple[str, dict]]) -> tuple[list, dict]:
    """`n_rounds` rounds of every arm (name -> (--linears, extra environment)), the order alternating
    round by round (the machine drifts): (rounds [{arm: record}], the first round's outputs per arm)."""
    from common import rotations

    names = list(arms)
    rounds, outputs = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, order in enumerate(rotations(names, n_rounds)):
            row = {}
            for arm in order:
                row[arm], outs = run_arm(draft, limit, arms[arm][0], Path(tmp) / f"{arm}{i}.json", arms[arm][1])
                outputs.setdefault(arm, outs)
                print(i, arm, {k: v for k, v in row[arm].items() if k not in ("cmd", "linears")}, flush=True)
            rounds.append(row)
    return rounds, outputs


def parse_args(doc: str, limit: int) -> argparse.Namespace:
    """--draft, --limit, --rounds: what an alternating eval benchmark takes."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", required=True, help="a demo's draft directory (DEMO_OUT/draft)")
    ap.add_argument("--limit", type=int, default=limit, help="MT-bench first turns per arm (plain decoding on all of them)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of the arms")
    return ap.parse_args()


def main() -> int:
    a = parse_args(__doc__, 24)
    from common import write_result

    rounds, outputs = alternate(a.draft, a.limit, a.rounds, {arm: (arm, {}) for arm in ARMS})
    ok = [r for r in rounds if all("error" not in r[x] for x in ARMS)]
    result = {
        "what": "the demo's eval stage (eaglenest.demo.eval_argv) with --linears torch vs --linears kernel, alternating",
        "draft": a.draft, "prompts": a.limit, "rounds": rounds,
        # per round: the kernel arm's eval seconds over the torch arm's (< 1 = faster)
        "kernel_over_torch_eval_s": [round(r["kernel"]["eval_elapsed_s"] / r["torch"]["eval_elapsed_s"], 3) for r in ok],
        "kernel_over_torch_spec_tokens_per_s": [round(r["kernel"]["spec_tokens_per_s_per_process"] / r["torch"]["spec_tokens_per_s_per_process"], 3) for r in ok],
        "kernel_over_torch_baseline_tokens_per_s": [round(r["kernel"]["baseline_tokens_per_s_per_process"] / r["torch"]["baseline_tokens_per_s_per_process"], 3) for r in ok],
        "texts_identical": sum(x == y for x, y in zip(outputs.get("torch", []), outputs.get("kernel", []))),
        "texts_compared": min((len(o) for o in outputs.values()), default=0),
    }
    from eaglenest.native.gemv import isa

    result["isa"] = isa()  # the AVX512-BF16 build's file keeps its first name
    write_result("eval_gemv_cpu" if result["isa"] == "avx512-bf16" else f"eval_gemv_cpu_{result['isa']}", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
