"""A second real architecture, measured: the same short recipe on Qwen2.5-Coder-0.5B-Instruct (qwen2,
24 layers, hidden 896, vocab 151936) and, as the anchor in the same run, SmolLM2-135M-Instruct
(llama): prepare -> capture (hf) -> train -> export -> check-draft -> eval, tau on the first 20
MT-bench questions (first turns, held out from training).

    nice -n 10 .venv/bin/python bench/qwen25_coder_tau.py [--samples 300] [--out /tmp/qwen_bench]

Writes bench/results/qwen25_coder_tau.json.  CPU heavy (about an hour on 2 heavily shared cores); the load
average is recorded at each stage (the machine is shared, so times are upper bounds).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

RECIPE = {  # short (60 steps, 4 % of the demo's 1,346): the comparison of the two targets is what counts
    "samples": 160, "max_length": 384, "ttt_steps": 3, "draft_vocab": 8192, "lr": 5e-4, "max_steps": 60,
    "batch_tokens": 1024, "eval_limit": 20, "eval_max_new_tokens": 48, "steps": 3, "topk": 1,
}


def run_target(name: str, out: Path, recipe: dict) -> dict:
    from eaglenest.cli import main
    from eaglenest.data import prepare
    from eaglenest.models.fetch import fetch
    from eaglenest.utils import cpu_has_fast_bf16

    model = str(fetch(name))
    out.mkdir(parents=True, exist_ok=True)
    data, feats, run, draft, report = out / "data", out / "feats", out / "run", out / "draft", out / "report.json"
    times, load = {}, {}

    def stage(key, fn):
        t = time.time()
        fn()
        times[key] = round(time.time() - t, 1)
        load[key] = [round(x, 2) for x in os.getloadavg()]
        print(f"[{name}] {key}: {times[key]} s, load {load[key]}", file=sys.stderr, flush=True)

    def cli(argv):
        rc = main(argv)
        if rc != 0:
            raise SystemExit(f"eaglenest {' '.join(argv)} exited with {rc}")

    if not (data / "meta.json").exists():
        stage("prepare", lambda: prepare(model=model, data=["sharegpt:"], out=data, max_length=recipe["max_length"],
                                         limit=recipe["samples"], verbose=False))
    stage("capture", lambda: cli(["capture", "--model", model, "--data", str(data), "--out", str(feats), "--device", "cpu"]))
    dtype = "bf16" if cpu_has_fast_bf16() else "fp32"
    if not (run / "final.json").exists():
        stage("train", lambda: cli(["train", "--model", model, "--features", str(feats), "--out", str(run),
                                    "--ttt-steps", str(recipe["ttt_steps"]), "--draft-vocab", str(recipe["draft_vocab"]),
                                    "--lr", str(recipe["lr"]), "--max-steps", str(recipe["max_steps"]),
                                    "--batch-tokens", str(recipe["batch_tokens"]), "--device", "cpu", "--dtype", dtype,
                                    "--eval-fraction", "0.05"]))
    stage("export", lambda: cli(["export", "--run", str(run), "--out", str(draft), "--model", model]))
    stage("check-draft", lambda: cli(["check-draft", str(draft), "--model", model]))
    stage("eval", lambda: cli(["eval", "--model", model, "--draft", str(draft), "--out", str(report), "--bench", "mtbench",
                               "--limit", str(recipe["eval_limit"]), "--steps", str(recipe["steps"]), "--topk", str(recipe["topk"]),
                               "--temperature", "0", "--max-new-tokens", str(recipe["eval_max_new_tokens"]), "--device", "cpu"]))
    r = json.loads(report.read_text())
    final = json.loads((run / "final.json").read_text())
    rc = json.loads((run / "config.json").read_text())
    cfg = json.loads((Path(model) / "config.json").read_text())
    return {
        "target": name, "model_type": cfg["model_type"], "layers": cfg["num_hidden_layers"], "hidden": cfg["hidden_size"],
        "vocab": cfg["vocab_size"], "train_dtype": dtype, "train_steps": rc["total_steps"], "train_tokens": rc["n_train_tokens"],
        "draft_shape": {k: rc["draft"][k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")},
        "held_out": final.get("eval"), "tau": r["tau"], "accept_per_position": r["accept_per_position"],
        "greedy_matches_baseline": r["greedy_matches_baseline"], "baseline_prompts": r["baseline_prompts"],
        "texts_compared": r["texts_compared"], "speedup": r.get("speedup"), "n_prompts": r["n_prompts"],
        "generated_tokens": r["generated_tokens"], "verify_steps": r["verify_steps"], "stage_seconds": times, "loadavg": load,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/eaglenest-qwen25-bench")
    ap.add_argument("--samples", type=int, default=RECIPE["samples"])
    ap.add_argument("--targets", default="qwen25-coder,smollm2")
    ap.add_argument("--note", default=None, help="free text recorded with the result (e.g. a resumed stage's first timing)")
    a = ap.parse_args()
    recipe = {**RECIPE, "samples": a.samples}
    import torch
    import transformers

    results = [run_target(t, Path(a.out) / t, recipe) for t in a.targets.split(",")]
    write_result("qwen25_coder_tau", {
        "what": "tau of the same short recipe on Qwen2.5-Coder-0.5B-Instruct and on SmolLM2-135M-Instruct (anchor, same run)",
        "recipe": recipe, "benchmark": "MT-bench first turns, first 20 questions, greedy, batch 1",
        "results": results, "shared_machine": True, "note": a.note,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    })


if __name__ == "__main__":
    main()
