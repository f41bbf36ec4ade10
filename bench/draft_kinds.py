"""The draft kinds side by side, same data, same steps, same seed, one run each.

SmolLM2 (the demo recipe on the team's shared demo store, bench/arms.py): EAGLE-3 vs EAGLE 3.1's
flags alone and together; tau and acceptance per position on all 80 MT-bench first turns at
temperature 0 and 1 (our decoder, 3 steps, topk 1, 128 new tokens), held-out accuracy per TTT
position, training cost.  The tiny DeepSeek-V3 target (MLA + MoE, random weights, built in-process
like the tests' target): a GQA and an MLA draft trained identically on the target's own features
of the same demo conversations; held-out accuracy per TTT position, parameters, decoding-cache
bytes per token; plus both kinds' sizes at Kimi-K2.5's shape (meta device, `train --dry-run`).

    python bench/draft_kinds.py arm k-eagle31   # train + decode at T=0 and T=1 (resumes; under /work/team/heavy)
    python bench/draft_kinds.py mla             # the tiny DeepSeek-V3 comparison (resumes)
    python bench/draft_kinds.py report          # -> bench/results/draft_kinds.json

Each piece appends the commit it ran at to WORK/<arm>/provenance.jsonl (the report carries them):
a result is only as reproducible as the code that made every part of it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import arms  # noqa: E402
from common import git_state, write_result  # noqa: E402

ARMS = {  # name -> train flags on top of the demo recipe
    "k-eagle3": [],
    "k-fcnorm": ["--fc-norm"],
    "k-normout": ["--norm-output"],
    "k-eagle31": ["--fc-norm", "--norm-output"],
}
TEMPERATURES = (0.0, 1.0)
MLA_ARMS = {"gqa": ["--draft-attention", "gqa"], "mla": ["--draft-attention", "mla"]}
MLA_SAMPLES = 600  # demo conversations the tiny DeepSeek-V3 target is captured on


def _provenance(d: Path, piece: str) -> None:
    d.mkdir(parents=True, exist_ok=True)
    with (d / "provenance.jsonl").open("a") as f:
        f.write(json.dumps({"piece": piece, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **git_state()}) + "\n")


def run_arm(name: str) -> None:
    d = arms.arm_dir(name)
    if not (d / "run" / "final.json").exists():
        _provenance(d, "train")
        arms.train_arm(name, ARMS[name])
    for t in TEMPERATURES:
        _provenance(d, f"eval-t{t:g}")
        r = arms.eval_arm(name, t)
        print(f"{name} T={t:g}: tau {r['tau']:.4f} accept {r['accept_per_position']}")


# --- the tiny DeepSeek-V3 target: GQA vs MLA -----------------------------------------------------
def mla_root() -> Path:
    return arms.work_root() / "tiny-dsv3"


def run_mla() -> None:
    """Capture the tiny DeepSeek-V3 target on the first demo conversations (hf engine, fp32), then
    train a GQA and an MLA draft with the same recipe (the demo's, shorter: a 64-wide target)."""
    sys.path.insert(0, str(HERE.parent / "tests"))
    from family_helpers import tiny_deepseek

    root = mla_root()
    target = tiny_deepseek(root / "target", Path(arms.model_path()))
    data = arms.work_root() / "data"
    feats = root / "features"
    arms._cli(["capture", "--model", str(target), "--data", str(data), "--out", str(feats), "--dtype", "fp32", "--limit", str(MLA_SAMPLES)])
    for kind, flags in MLA_ARMS.items():
        d = root / kind
        run = d / "run"
        if (run / "final.json").exists():
            continue
        _provenance(d, "train")
        argv = ["train", "--model", str(target), "--features", str(feats), "--out", str(run), *mla_recipe(), *flags]
        if (run / "checkpoints" / "latest.json").exists():
            argv.append("--resume")
        t0 = time.time()
        arms._cli(argv)
        (d / "timing.json").write_text(json.dumps({"wall_s": time.time() - t0, "argv": argv}) + "\n")


def mla_recipe() -> list[str]:
    """The demo recipe (bench/arms.py train_flags) in fp32 (bf16 buys nothing at width 64) and with
    the whole vocabulary as the draft's: a random target's next tokens are not the data's frequent
    ones (an 8K draft vocabulary holds almost none of them: no loss, no accuracy)."""
    flags = arms.train_flags()
    flags[flags.index("--dtype") + 1] = "fp32"
    flags[flags.index("--draft-vocab") + 1] = "49152"
    return flags


def _final(run: Path) -> dict:
    f = json.loads((run / "final.json").read_text())
    return {"held_out": f.get("eval"), "steps": f.get("step")}


def mla_summary() -> dict:
    from eaglenest.draft.model import DraftConfig
    from eaglenest.train.dryrun import draft_sizes
    from eaglenest.utils import read_json

    root = mla_root()
    out = {"target": "tiny DeepSeek-V3 (tests/family_helpers.py: 8 layers, hidden 64, 4 heads, q_lora 32, kv_lora 512, "
                     "rope 64, nope 32, v 32, MoE 8 experts top-2, YaRN; random weights)",
           "samples_captured": MLA_SAMPLES, "recipe": mla_recipe(), "kinds": {}, "kinds_not_run": []}
    for kind in MLA_ARMS:
        d = root / kind
        if not (d / "run" / "final.json").exists():
            out["kinds_not_run"].append(kind)  # said, never filled in
            continue
        rc = read_json(d / "run" / "config.json")
        cfg = DraftConfig.from_dict(rc["draft"])
        out["kinds"][kind] = {**_final(d / "run"), **draft_sizes(cfg), "draft_config": rc["draft"],
                              "timing": read_json(d / "timing.json"), "provenance": _lines(d / "provenance.jsonl")}
    return out


def _mla_or_carried(previous: dict | None) -> dict:
    out = mla_summary()
    if not out["kinds"] and previous and previous.get("tiny_deepseek_v3", {}).get("kinds"):
        out = dict(previous["tiny_deepseek_v3"])  # measured by an earlier run of this script elsewhere
        out.setdefault("carried_from", {k: previous[k] for k in ("date", "git_commit", "machine")})
    return out


def kimi_sizes() -> dict:
    """Both kinds at Kimi-K2.5's shape (full vocabulary, as the published drafts), on the meta device."""
    sys.path.insert(0, str(HERE.parent / "tests"))
    from family_helpers import KIMI_K25_TEXT

    from eaglenest.capture.layers import default_layer_ids
    from eaglenest.draft.model import DraftConfig
    from eaglenest.train.dryrun import draft_sizes

    k = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"], "text_config": KIMI_K25_TEXT}
    return {kind: draft_sizes(DraftConfig.from_target(k, 163840, default_layer_ids(61), attention=kind)) for kind in ("gqa", "mla")}


def _lines(p: Path) -> list[dict]:
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def _complete(name: str) -> bool:
    return (arms.arm_dir(name) / "run" / "final.json").exists() and all(arms.eval_report(name, t).exists() for t in TEMPERATURES)


# bench/losses.py's `ce` arm trains EAGLE-3 with the demo recipe on the same store: where k-eagle3 was
# not run on this machine, it is the reference the other arms are paired with (checked: same argv)
SAME_AS_EAGLE3 = "l-ce"


def _train_argv(name: str) -> list[str]:
    argv = json.loads((arms.arm_dir(name) / "timing.json").read_text())["argv"]
    out = argv.index("--out")
    argv = argv[:out] + argv[out + 2:]
    return argv[:-2] if argv[-2:] == ["--loss", "ce"] else argv  # ce is the default loss


def reference_arm() -> str | None:
    """The EAGLE-3 arm the others are paired with on this machine (None: none is here)."""
    if _complete("k-eagle3"):
        return "k-eagle3"
    eagle3 = ["train", "--model", arms.model_path(), "--features", str(arms.work_root() / "features"), *arms.train_flags()]
    if _complete(SAME_AS_EAGLE3) and _train_argv(SAME_AS_EAGLE3) == eagle3:
        return SAME_AS_EAGLE3
    return None


def _carried(previous: dict | None, name: str) -> dict | None:
    """An arm measured in an earlier run of this script on another machine (its work directory is not
    here): kept as that run wrote it, with where it came from."""
    if not previous or name not in previous.get("smollm2", {}).get("arms", {}):
        return None
    a = dict(previous["smollm2"]["arms"][name])
    a.setdefault("carried_from", {k: previous[k] for k in ("date", "git_commit", "machine")})
    return a


def report() -> None:
    prev_path = HERE / "results" / "draft_kinds.json"
    previous = json.loads(prev_path.read_text()) if prev_path.exists() else None
    ref = reference_arm()
    smol, not_run = {}, []
    for name, flags in ARMS.items():
        d = arms.arm_dir(name)
        if not _complete(name):
            if (a := _carried(previous, name)) is not None:
                smol[name] = a
            else:
                not_run.append(name)  # said in the report, never filled in
            continue
        s = arms.arm_summary(name)
        evals = {}
        for t in TEMPERATURES:
            r = arms.eval_arm(name, t)  # cached: reads the stored report
            evals[f"t{t:g}"] = {k: r.get(k) for k in ("tau", "accept_per_position", "n_prompts", "n_generations", "generated_tokens",
                                                   "verify_steps", "temperature", "max_new_tokens", "steps", "topk", "greedy_matches_baseline")}
        smol[name] = {"flags": flags, "held_out": s["final_eval"], "steps": s["steps"], "timing": s["timing"], "eval": evals,
                      "provenance": _lines(d / "provenance.jsonl")}
        if name != "k-eagle3" and ref:  # against the EAGLE-3 arm trained here, paired by prompt
            smol[name]["delta_tau_vs_k-eagle3"] = {f"t{t:g}": arms.paired_delta_tau(arms.eval_arm(ref, t), arms.eval_arm(name, t))
                                                    for t in TEMPERATURES}
            if ref != "k-eagle3":
                r = {f"t{t:g}": arms.eval_arm(ref, t)["tau"] for t in TEMPERATURES}
                smol[name]["eagle3_reference"] = {"arm": ref, "tau": r, "why": "k-eagle3 was not run on this machine; bench/losses.py's "
                                                  "ce arm is the same training (same argv, store, seed), re-run here"}
    write_result("draft_kinds", {
        "what": "EAGLE-3 vs EAGLE 3.1 (fc_norm, norm_output, both) on SmolLM2 with the demo recipe, one run each on the same "
                "store, seed and steps; tau on all 80 MT-bench first turns (our decoder, 3 steps, topk 1, 128 new tokens) at "
                "temperature 0 and 1. GQA vs MLA drafts on the tiny DeepSeek-V3 target (same data, recipe, seed). Kimi-K2.5 "
                "shape sizes computed on the meta device.",
        "smollm2": {"recipe": arms.train_flags(), "store": str(arms.work_root() / "features"), "prompts": 80, "arms": smol,
                    "arms_not_run": not_run},
        "tiny_deepseek_v3": _mla_or_carried(previous),
        "kimi_k25_shape": kimi_sizes(),
    })


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["arm", "mla", "report"])
    ap.add_argument("name", nargs="?", choices=list(ARMS))
    a = ap.parse_args()
    if a.what == "arm":
        if not a.name:
            ap.error("arm NAME")
        run_arm(a.name)
    elif a.what == "mla":
        run_mla()
    else:
        report()


if __name__ == "__main__":
    main()
