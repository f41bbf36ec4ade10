"""Training losses side by side on the demo's recipe (issue 24.4): ce vs lk_hybrid vs nla (vs tv),
one run each, the same data, steps and seed (bench/arms.py), each decoded on all 80 MT-bench first
turns at temperature 0 and 1 (3 steps, topk 1, 128 tokens; at temperature 1 the draft's tokens are
sampled and verified with min(1, p/q)), with the tau the training log predicted beside the decoded:
from the held-out ShareGPT split at the end of training (`final.json`: accept at T0 = argmax
agreement, at T1 = alpha).  A teacher-forced MT-bench proxy scored beside it is a retired probe
(docs/benchmarks.md; git show afe579c:bench/losses.py).

Run as resumable pieces (each under /work/team/heavy, logs beside the arms):
    python bench/losses.py train l-ce          # one arm's training (skipped when done)
    python bench/losses.py eval l-ce           # its two decodes (each skipped when done)
    python bench/losses.py report              # -> bench/results/losses.json
Work directory: $EAGLENEST_BENCH_WORK (the team's shared demo store: /work/scratch/shared).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

ARMS = {  # name -> the train flags added to the demo's recipe
    "l-ce": ["--loss", "ce"],
    "l-lkhybrid": ["--loss", "lk_hybrid", "--lk-eta", "3.0"],
    "l-nla": ["--loss", "nla"],
    "l-tv": ["--loss", "tv"],
}
TEMPERATURES = (0.0, 1.0)
PRESET = "full"


def train(name: str) -> None:
    from arms import train_arm

    train_arm(name, ARMS[name], PRESET)


def evaluate(name: str) -> None:
    from arms import eval_arm

    for t in TEMPERATURES:
        r = eval_arm(name, t, PRESET)
        print(f"{name} T={t:g}: tau {r['tau']:.3f}, accept per position {r['accept_per_position']}", file=sys.stderr)


def _r(x, n=4):
    return None if x is None else (round(x, n) if isinstance(x, float) else [round(v, n) for v in x])


def report(names: list[str]) -> None:
    from arms import arm_summary, eval_report, paired_delta_tau
    from common import write_result

    arms, decodes = {}, {}  # decodes[name][t]: the arm's decode report (read once)
    for name in names:
        s = arm_summary(name, PRESET)
        ev = s["final_eval"]
        decoded = {}
        decodes[name] = {t: json.loads(eval_report(name, t, PRESET).read_text()) for t in TEMPERATURES}
        for t in TEMPERATURES:
            r = decodes[name][t]
            key = "t0" if t == 0 else "t1"
            pred_held = ev["tau_t0"] if t == 0 else ev["tau_t1"]
            decoded[key] = {
                "tau": _r(r["tau"]), "accept_per_position": _r(r["accept_per_position"]), "prompts": r["n_prompts"],
                "verify_steps": r["verify_steps"], "verified_tokens": r["verified_tokens"], "temperature": r["temperature"],
                "draft_sampling": r.get("draft_sampling"), "max_new_tokens": r["max_new_tokens"], "steps": r["steps"],
                "predicted_tau_heldout": _r(pred_held), "gap_heldout": _r(pred_held / r["tau"] - 1),
            }
        arms[name] = {
            "flags": ARMS[name], "steps": s["steps"], "train_wall_s": _r(s["timing"]["wall_s"], 1) if s["timing"] else None,
            "heldout": {"acc": _r(ev["acc"]), "alpha": _r(ev["alpha"]), "alpha_argmax": _r(ev["alpha_argmax"]),
                        "tau_t0": _r(ev["tau_t0"]), "tau_t1": _r(ev["tau_t1"]), "tau_t1_argmax": _r(ev["tau_t1_argmax"]),
                        "loss": _r(ev["loss"])},
            "decoded": decoded,
        }
    if "l-ce" in arms:  # each arm against ce, paired by prompt (95 % interval from resampling the prompts)
        for name, a in arms.items():
            a["tau_vs_ce"] = {k: _r(a["decoded"][k]["tau"] / arms["l-ce"]["decoded"][k]["tau"] - 1) for k in ("t0", "t1")}
            if name != "l-ce":
                a["delta_tau_vs_ce"] = {
                    "t0" if t == 0 else "t1": {k: _r(v) if isinstance(v, (float, list)) else v
                                               for k, v in paired_delta_tau(decodes["l-ce"][t], decodes[name][t]).items()}
                    for t in TEMPERATURES}
    write_result("losses", {
        "what": "draft trained with each loss on the demo's recipe (same data, steps, seed), decoded on MT-bench first turns",
        "recipe": "eaglenest demo full preset (bench/arms.py train_flags) + the arm's --loss",
        "decode": {"prompts": 80, "turns": 1, "steps": 3, "topk": 1, "max_new_tokens": 128, "temperatures": list(TEMPERATURES),
                   "draft_sampling_t1": "sample", "engine": "hf (in-process decoder)"},
        "arms": arms,
        "arms_not_run": [n for n in ARMS if n not in arms],
    })


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["train", "eval", "report"])
    ap.add_argument("names", nargs="*", help=f"arms (of {', '.join(ARMS)}); report: default all that finished")
    a = ap.parse_args()
    if a.what in ("train", "eval"):
        for n in a.names:
            (train if a.what == "train" else evaluate)(n)
    else:
        from arms import arm_dir

        report(a.names or [n for n in ARMS if (arm_dir(n, PRESET) / "run" / "final.json").exists()])


if __name__ == "__main__":
    main()
