"""The fp8 feature store on real massive activations: Qwen2.5-Coder-0.5B-Instruct (the largest
outliers of the targets this machine can run) beside SmolLM2-135M-Instruct (the anchor the fp8
default was first measured on, bench/results/store_dtype.json).

    python bench/store_outliers.py data --root ROOT                 # prepare both targets' conversations
    python bench/store_outliers.py capture TARGET --root ROOT       # TARGET's bf16 store (hf engine; resumable)
    python bench/store_outliers.py measure TARGET --root ROOT       # outlier ratios, error, flushed share per scheme
    python bench/store_outliers.py variants --root ROOT             # the Qwen bf16 store -> one fp8 store per scheme
    python bench/store_outliers.py train VARIANT --root ROOT        # the recipe on ROOT/qwen25-coder/VARIANT (resumable)
    python bench/store_outliers.py eval VARIANT PART --root ROOT    # export + decode MT-bench first turns, part 0-3 (20 each)
    python bench/store_outliers.py report --root ROOT               # -> bench/results/store_outliers.json

measure: per aux layer and the final state, over the tokens of MEASURE_SAMPLES stored conversations,
  * how large the outliers are: per-channel RMS over tokens, max / median (the "massive
    activations"), and per token max|x| / median|x| (what one scale per (token, layer) must span);
  * per scheme (SCHEMES: the codec's own fp8_encode for power-of-two scales; the others simulated
    the same way), the relative error ||x^ - x|| / ||x|| (also after whitening every channel by its
    RMS, as the draft's fc is initialized: train/setup.py init_fc), and the share of non-zero values
    flushed to zero.
variants/train/eval: the same prepared data, seed, batches and recipe (RECIPE) for each store
  variant (bf16, fp8 with one scale per (token, layer), fp8 with one scale per 128 values); only
  the stored states differ.  tau on all 80 MT-bench first turns, greedy, and a paired bootstrap
  interval of each fp8 variant's per-prompt difference to bf16 (bench/online.py tau_interval).
Every step is resumable (a finished one is skipped); run them under /work/team/heavy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

TARGETS = ("qwen25-coder", "smollm2")
MEASURE_SAMPLES = 64  # conversations whose tokens the error measurement covers (spread over the store)
# scheme -> (values per scale: 0 = the layer, scale kind, subnormals kept, outlier values kept per (token, layer) in bf16)
SCHEMES = {
    "token-layer": (0, "pow2", False, 0),  # the fp8 store before fp8_block existed
    "token-layer-f32": (0, "f32", False, 0),
    "token-layer-subnormals": (0, "pow2", True, 0),
    "token-layer-keep8": (0, "pow2", False, 8),  # the 8 largest |x| of each (token, layer) in bf16 (+ a 2-byte index)
    "block128": (128, "pow2", False, 0),  # fp8_block 128 (the largest divisor of H <= 128)
    "block128-f32": (128, "f32", False, 0),
    "block32": (32, "pow2", False, 0),  # the OCP MX block size
}
# the store variants trained and decoded (name -> `features convert` arguments; bf16 = the capture)
VARIANTS = {"bf16": None, "fp8-token-layer": ["--store-dtype", "fp8", "--fp8-block", "0"],
            "fp8-block128": ["--store-dtype", "fp8", "--fp8-block", "128"]}
RECIPE = {  # the demo's full preset (eaglenest/demo.py), shortened to fit Qwen on 2 shared cores
    "samples": 400, "max_length": 512, "ttt_steps": 3, "draft_vocab": 8192, "lr": 1e-3, "epochs": 2,
    "batch_tokens": 1024, "eval_fraction": 0.05, "seed": 0,
    "eval_prompts": 80, "eval_max_new_tokens": 64, "eval_steps": 3, "eval_topk": 1, "eval_attention": "auto (rowwise on a CPU)",
}
EVAL_PARTS = 4  # MT-bench decoded in 4 pieces of 20 questions (one heavy-lock turn each)


def _model(target: str) -> str:
    from eaglenest.models.fetch import fetch

    return str(fetch(target))


def _cli(argv: list[str]) -> None:
    from eaglenest.cli import main

    if main(argv) != 0:
        raise SystemExit(f"`eaglenest {' '.join(argv)}` failed")


def _done(path: Path, what: str) -> bool:
    if path.exists():
        print(f"{what}: done already ({path})", file=sys.stderr)
        return True
    return False


# --- measure -------------------------------------------------------------------------------------

def quantize(x, scheme: str):
    """x [T, H] (float32 holding bf16 values) -> what the store would give back under `scheme` (float32)."""
    import torch

    from eaglenest.features.store import FP8_MAX, fp8_block_for, fp8_decode, fp8_encode

    block, kind, subnormals, keep = SCHEMES[scheme]
    T, H = x.shape
    b = fp8_block_for(H, block) if block else H
    if keep:  # the k largest |x| of each row kept exactly, the rest encoded without them
        idx = x.abs().topk(keep, dim=-1).indices
        kept = x.gather(1, idx)
        x = x.scatter(1, idx, 0.0)
    if kind == "pow2" and not subnormals:
        y = fp8_decode(*fp8_encode(x.bfloat16(), b)).float()  # the codec itself
    else:
        v = x.view(T, H // b, b)
        amax = v.abs().amax(-1, keepdim=True)
        s = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX))) if kind == "pow2" else amax / FP8_MAX
        s = torch.where(amax > 0, s, torch.ones_like(s))
        c = (v / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
        if not subnormals:
            c = torch.where(c.abs() < 2.0**-6, torch.zeros_like(c), c)
        y = (c * s).view(T, H)
    if keep:
        y = y.scatter(1, idx, kept)
    return y


def scheme_bytes(scheme: str, H: int) -> float:
    """Stored bytes per value of a layer (codes + scales + kept outliers)."""
    from eaglenest.features.store import fp8_block_for

    block, kind, _, keep = SCHEMES[scheme]
    b = fp8_block_for(H, block) if block else H
    return 1 + (1 if kind == "pow2" else 4) / b + keep * 4 / H


def layer_stats(x, first) -> dict:
    """Outlier statistics of one layer's states x [T, H] (float32); `first`: rows at position 0."""
    import torch

    a = x.abs()
    rest = ~first
    rms = x[rest].pow(2).mean(0).sqrt()
    rms_all = x.pow(2).mean(0).sqrt()
    med_tok = a.median(-1).values.clamp_min(1e-30)
    ratio_tok = a.amax(-1) / med_tok
    top = torch.topk(a.amax(0), 3)
    q = torch.tensor([0.5, 0.99])
    return {
        "channel_rms_max_over_median": round(float(rms_all.max() / rms_all.median()), 1),
        "channel_rms_max_over_median_first_token_out": round(float(rms.max() / rms.median()), 1),
        "token_max_over_median": {"median": round(float(ratio_tok.quantile(q[0])), 1), "p99": round(float(ratio_tok.quantile(q[1])), 1),
                                  "max": round(float(ratio_tok.max()), 1),
                                  "first_token_median": round(float(ratio_tok[first].median()), 1) if first.any() else None},
        "tokens_over_1e3": round(float((ratio_tok > 1e3).float().mean()), 5),
        "tokens_over_1e4": round(float((ratio_tok > 1e4).float().mean()), 5),
        "top_channels": [int(i) for i in top.indices], "top_channels_max_abs": [round(float(v), 1) for v in top.values],
        "median_abs": round(float(a.median()), 5),
    }


def scheme_stats(x, y, first, rms) -> dict:
    """Error of y (decoded) against x (stored bf16 values, float32)."""
    nz = x != 0
    flushed = nz & (y == 0)
    rest = ~first
    d = y - x
    w = rms.clamp_min(1e-6)
    per_tok = d.norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-30)
    return {
        "rel_err": round(float(d.norm() / x.norm()), 5),
        "rel_err_first_token_out": round(float(d[rest].norm() / x[rest].norm()), 5),
        "rel_err_whitened": round(float((d / w).norm() / (x / w).norm()), 5),
        "rel_err_whitened_first_token_out": round(float((d[rest] / w).norm() / (x[rest] / w).norm()), 5),
        "token_rel_err_max": round(float(per_tok.max()), 4),
        "flushed": round(float(flushed.sum() / nz.sum()), 6),
        "flushed_first_token_out": round(float(flushed[rest].sum() / nz[rest].sum()), 6),
        "flushed_first_token": round(float(flushed[first].sum() / nz[first].sum()), 4) if first.any() else None,
        "tokens_with_half_flushed": round(float(((flushed.sum(-1) * 2) > nz.sum(-1)).float().mean()), 5),
    }


def measure(args) -> None:
    import torch

    from eaglenest.features import FeatureStore

    torch.set_num_threads(args.threads)
    root = Path(args.root) / args.target
    out = root / "measure.json"
    if _done(out, "measure"):
        return
    fs = FeatureStore(root / "bf16")
    n = min(MEASURE_SAMPLES, len(fs))
    pick = sorted({round(i * (len(fs) - 1) / max(1, n - 1)) for i in range(n)})
    samples = [fs[i] for i in pick]
    H, L = fs.meta.hidden_size, len(fs.meta.layer_ids)
    first = torch.cat([torch.arange(len(s["input_ids"])) == 0 for s in samples])
    layers = {f"aux_{k}": torch.cat([s["aux_hidden_states"][:, j * H : (j + 1) * H] for s in samples]).float()
              for j, k in enumerate(fs.meta.layer_ids)}
    layers[f"final_{fs.meta.final_norm}_norm"] = torch.cat([s["last_hidden_state"] for s in samples]).float()
    res = {"target": fs.meta.target, "hidden_size": H, "num_layers": fs.meta.num_layers, "aux_layer_ids": fs.meta.layer_ids,
           "samples": len(samples), "tokens": int(first.numel()), "store_samples": len(fs), "layers": {}}
    for name, x in layers.items():
        t = time.time()
        rms = x[~first].pow(2).mean(0).sqrt()
        rec = {"outliers": layer_stats(x, first), "schemes": {}}
        for sc in SCHEMES:
            rec["schemes"][sc] = scheme_stats(x, quantize(x, sc), first, rms)
        res["layers"][name] = rec
        print(f"[{args.target}] {name}: channel max/median {rec['outliers']['channel_rms_max_over_median']}, "
              + ", ".join(f"{sc} err {v['rel_err']:.4f} w {v['rel_err_whitened']:.4f} flushed {v['flushed']:.2e}"
                          for sc, v in rec["schemes"].items()) + f" ({time.time() - t:.0f} s)", file=sys.stderr, flush=True)
    res["bytes_per_value"] = {sc: round(scheme_bytes(sc, H), 5) for sc in SCHEMES}
    out.write_text(json.dumps(res, indent=1))


# --- data, capture, variants, train, eval -------------------------------------------------------

def data(args) -> None:
    from eaglenest.data import prepare

    for t in TARGETS:
        d = Path(args.root) / t / "data"
        if not _done(d / "meta.json", f"data {t}"):
            prepare(model=_model(t), data=["sharegpt:"], out=d, max_length=RECIPE["max_length"], limit=RECIPE["samples"],
                    verbose=False)


def capture(args) -> None:
    root = Path(args.root) / args.target
    limit = [] if args.target == "qwen25-coder" else ["--limit", str(MEASURE_SAMPLES)]  # the anchor: measured only
    t = time.time()
    _cli(["capture", "--model", _model(args.target), "--data", str(root / "data"), "--out", str(root / "bf16"),
          "--device", "cpu", "--dtype", "bf16", "--store-dtype", "bf16", *limit])
    _log(root, "capture", time.time() - t)


def _log(root: Path, stage: str, seconds: float, **kw) -> None:
    with open(root / "stages.jsonl", "a") as f:
        f.write(json.dumps({"stage": stage, "wall_s": round(seconds, 1), "loadavg": [round(x, 2) for x in os.getloadavg()],
                            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **kw}) + "\n")


def variants(args) -> None:
    root = Path(args.root) / "qwen25-coder"
    for v, conv in VARIANTS.items():
        if conv is not None:
            t = time.time()
            _cli(["features", "convert", str(root / "bf16"), *conv, "--out", str(root / v)])  # resumes; a finished one is a no-op
            _log(root, f"convert {v}", time.time() - t)


def _train_dtype() -> str:
    from eaglenest.demo import _train_dtype as td

    return td("auto-cpu-bf16", "cpu")


def train(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    root = Path(args.root) / "qwen25-coder"
    run = root / "runs" / args.variant
    if _done(run / "final.json", f"train {args.variant}"):
        return
    R = RECIPE
    flags = {"model": _model("qwen25-coder"), "features": root / args.variant, "out": run, "ttt-steps": R["ttt_steps"],
             "draft-vocab": R["draft_vocab"], "lr": R["lr"], "epochs": R["epochs"], "batch-tokens": R["batch_tokens"],
             "eval-fraction": R["eval_fraction"], "seed": R["seed"], "device": "cpu", "dtype": _train_dtype(),
             "save-every": 100,  # a piece stopped at its time limit resumes from the last 100 steps
             "max-steps": args.max_steps}  # max-steps: smoke runs of this script only, not the measurement
    argv = ["train"] + [x for k, v in flags.items() if v is not None for x in (f"--{k}", str(v))]
    t = time.time()
    _cli(argv + ["--resume" if (run / "checkpoints" / "latest.json").exists() else "--overwrite"])
    _log(root, f"train {args.variant}", time.time() - t, threads=args.threads)


def _bench_part(root: Path, part: int) -> Path:
    """MT-bench's questions part `part` of EVAL_PARTS (the same rows `--bench mtbench` reads), so
    that each decode piece fits one turn of the heavy lock and a stopped one resumes by part."""
    from eaglenest.evaluate.mtbench import load_mtbench, mtbench_path

    load_mtbench()  # checks the 80 rows
    rows = mtbench_path().read_text().splitlines()
    n = -(-len(rows) // EVAL_PARTS)
    f = root / "bench" / f"mtbench-part{part}.jsonl"
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text("\n".join(rows[part * n : (part + 1) * n]) + "\n")
    return f


def evaluate(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    root = Path(args.root) / "qwen25-coder"
    run = root / "runs" / args.variant
    draft, report = run / "draft", run / f"mtbench-part{args.part}.json"
    if _done(report, f"eval {args.variant} part {args.part}"):
        return
    model, R = _model("qwen25-coder"), RECIPE
    if not (draft / "config.json").exists():
        _cli(["export", "--run", str(run), "--out", str(draft), "--model", model])
    t = time.time()
    _cli(["eval", "--model", model, "--draft", str(draft), "--out", str(report), "--bench", str(_bench_part(root, args.part)),
          "--steps", str(R["eval_steps"]), "--topk", str(R["eval_topk"]), "--temperature", "0",
          "--max-new-tokens", str(R["eval_max_new_tokens"]), "--device", "cpu", "--no-baseline", "--workers", str(args.workers)])
    _log(root, f"eval {args.variant} part {args.part}", time.time() - t, workers=args.workers)


def _eval_parts(run: Path) -> list[dict] | None:
    """The decode reports of all EVAL_PARTS parts of a run (None until all are there)."""
    parts = [run / f"mtbench-part{k}.json" for k in range(EVAL_PARTS)]
    return [json.loads(p.read_text()) for p in parts] if all(p.exists() for p in parts) else None


# --- report --------------------------------------------------------------------------------------

def report(args) -> None:
    import common
    from online import tau_interval

    from eaglenest.features import FeatureStore
    from eaglenest.features.store import bytes_per_token, fp8_block_for

    root = Path(args.root)
    out = {"kind": "store_outliers", "what": __doc__.split("\n\n")[0].replace("\n", " "), "schemes": {
        sc: {"values_per_scale": b or "layer", "scale": k, "subnormals_kept": s, "outliers_kept_bf16": keep}
        for sc, (b, k, s, keep) in SCHEMES.items()}, "measure": {}}
    for t in TARGETS:
        m = root / t / "measure.json"
        if m.exists():
            out["measure"][t] = json.loads(m.read_text())
            out["measure"][t]["block128_values"] = fp8_block_for(out["measure"][t]["hidden_size"], 128)  # what "block128" is there
    q = root / "qwen25-coder"
    tau = {}
    for v in VARIANTS:
        run = q / "runs" / v
        rec = {}
        if (q / v).exists():
            fs = FeatureStore(q / v)
            rec.update(store=fs.meta.scheme, bytes_per_token=bytes_per_token(fs.meta.hidden_size, fs.meta.dtype, fp8_block=fs.meta.fp8_block),
                       bytes_on_disk_per_token=round(fs.bytes_on_disk() / fs.n_tokens, 1), samples=len(fs), tokens=fs.n_tokens)
        if (run / "final.json").exists():
            ev = json.loads((run / "final.json").read_text())["eval"]
            metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
            rec.update(heldout_acc=[round(a, 4) for a in ev["acc"]], heldout_loss=[round(a, 4) for a in ev["loss"]],
                       steps=metrics[-1]["step"], train_tokens=sum(r["tokens"] for r in metrics))
        parts = _eval_parts(run)
        if parts:
            pp = [p for r in parts for p in r["per_prompt"]]
            steps = sum(p["verify_steps"] for p in pp)
            acc = [sum(r["accept_per_position"][k] * r["verify_steps"] for r in parts) / steps for k in range(RECIPE["eval_steps"])]
            rec.update(tau=round(sum(p["verified_tokens"] for p in pp) / steps, 4), accept_per_position=[round(a, 4) for a in acc],
                       generated_tokens=sum(r["generated_tokens"] for r in parts), verify_steps=steps,
                       n_prompts=sum(r["n_prompts"] for r in parts), verification=parts[0].get("verification"))
            tau[v] = pp
            rec["per_prompt"] = [{k: p[k] for k in ("id", "tau", "verified_tokens", "verify_steps")} for p in pp]
        out.setdefault("variants", {})[v] = rec
    if "bf16" in tau:
        b = tau["bf16"]
        for v, pp in tau.items():
            if v == "bf16":
                continue
            iv = tau_interval(b, pp)
            tb = out["variants"]["bf16"]["tau"]
            out["variants"][v]["tau_minus_bf16"] = {"diff": round(iv["diff"], 4), "ci95": [round(x, 4) for x in iv["ci95"]],
                                                    "bootstrap": iv["bootstrap"], "pct": round(100 * iv["diff"] / tb, 2),
                                                    "ci95_pct": [round(100 * x / tb, 2) for x in iv["ci95"]]}
            # verification is exact (rowwise): every store's decode should emit the target's own greedy text
            out["variants"][v]["texts_compared"] = len(pp)
            out["variants"][v]["texts_identical_to_bf16"] = sum(a["output_ids"] == c["output_ids"] for a, c in zip(b, pp))
    if (q / "data" / "meta.json").exists():
        meta = json.loads((q / "data" / "meta.json").read_text())
        out["recipe"] = {**RECIPE, "prepared_samples": meta.get("n_samples"), "prepared_tokens": meta.get("n_tokens"),
                         "train_dtype": _train_dtype(), "target": "Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, hidden 896)",
                         "eval": "MT-bench first turns, greedy, chain of eval_steps, batch 1, hf engine, no plain-decoding baseline"}
    if (q / "stages.jsonl").exists():
        out["stages"] = [json.loads(x) for x in (q / "stages.jsonl").read_text().splitlines()]
    out["bytes_per_token_kimi_k25_shape"] = {"bf16": bytes_per_token(7168, "bf16"), "fp8-token-layer": bytes_per_token(7168, "fp8", fp8_block=7168),
                                             "fp8-block128": bytes_per_token(7168, "fp8", fp8_block=128)}
    out["goal"] = "|tau(fp8 scheme) - tau(bf16)| <= 1 % of tau(bf16) on Qwen2.5-Coder-0.5B-Instruct, the same recipe and batches"
    out["note"] = args.note
    common.write_result("store_outliers", out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("data")
    for name in ("capture", "measure"):
        sub.add_parser(name).add_argument("target", choices=TARGETS)
    sub.add_parser("variants")
    for name in ("train", "eval"):
        p = sub.add_parser(name)
        p.add_argument("variant", choices=list(VARIANTS))
        if name == "train":
            p.add_argument("--max-steps", type=int, default=None, help="smoke runs only: cut the recipe short")
        else:
            p.add_argument("part", type=int, choices=range(EVAL_PARTS), help=f"which of the {EVAL_PARTS} parts of MT-bench")
            p.add_argument("--workers", type=int, default=2, help="eval processes (each decodes a share of the prompts)")
    p = sub.add_parser("report")
    p.add_argument("--note", default=None, help="free text recorded with the result")
    for p in sub.choices.values():
        p.add_argument("--root", required=True)
        p.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    {"data": data, "capture": capture, "measure": measure, "variants": variants, "train": train, "eval": evaluate,
     "report": report}[a.cmd](a)


if __name__ == "__main__":
    main()
