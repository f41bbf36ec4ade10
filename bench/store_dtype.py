"""What a compact feature store costs in tau: the demo recipe on the bf16 store and on each compact variant.

    python bench/store_dtype.py variants --bf16 FEAT --root ROOT          # fp8, fp8-aux (convert) and topk (below)
    python bench/store_dtype.py capture-speed --data DATA --root ROOT     # capture tok/s, bf16 vs fp8 store, paired
    python bench/store_dtype.py train VARIANT --root ROOT                 # the demo's training recipe on ROOT/VARIANT
    python bench/store_dtype.py eval VARIANT --root ROOT --limit 40       # export + decode MT-bench's first N questions
    python bench/store_dtype.py mt VARIANT --root ROOT --proxy MT/features  # bench/tau_levers.py's MT-bench proxy
    python bench/store_dtype.py report --root ROOT [--limit 40]           # -> bench/results/store_dtype.json

Variants (same prepared data, seed and steps; only the stored states differ):
  bf16     the store as captured;
  fp8      aux and final states float8 e4m3, a power-of-two scale per token and per layer;
  fp8-aux  aux states fp8, the final state (which feeds the teacher's logits) bf16;
  topk     aux states fp8, and instead of the final state the target's top-K log-probabilities
           (K=32: int32 ids + fp16 log-probs, 192 B/token), i.e. the teacher itself.  Not a store
           dtype (yet): measured here through a patch -- the K ids and log-probs are packed into
           the first 4K columns of the stored final state (exact: fp16 log-probs as two bf16
           halves, ids as two bytes) and Teacher.targets is replaced by one that renormalizes the
           top-K over the draft vocabulary (argmax = the top-1 id); bytes/token are those of the
           real layout, computed.
Every step is resumable (a finished one is skipped); run them niced: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

VARIANTS = ("bf16", "fp8", "fp8-aux", "topk")
TOPK = 32


def _model() -> str:
    from eaglenest.models.fetch import fetch

    return str(fetch("smollm2"))


def _cli(argv: list[str]) -> None:
    from eaglenest.cli import main

    if main(argv) != 0:
        raise SystemExit(f"`eaglenest {' '.join(argv)}` failed")


def topk_bytes_per_token(hidden: int, k: int = TOPK) -> int:
    """fp8 aux (3H codes + 3 exponents) + K x (int32 id + fp16 log-prob) + ids and mask."""
    return 3 * hidden + 3 + k * 6 + 4 + 1


def build_topk(src: Path, dst: Path, k: int = TOPK) -> None:
    """The topk variant from the bf16 store: fp8 aux, packed top-K teacher in place of the final state."""
    import torch

    from eaglenest.features import FeatureStore, FeatureWriter
    from eaglenest.features.store import StoreMeta
    from eaglenest.models.weights import target_head
    from eaglenest.utils import progress

    fs = FeatureStore(src)
    assert fs.meta.final_norm == "post", "the packed teacher assumes a post-norm final state"
    W = target_head(_model())["lm_head"].bfloat16()  # [V, H]: the bf16-autocast trainer's teacher matmul
    w = FeatureWriter(dst, StoreMeta.from_dict({**fs.meta.to_dict(), "dtype": "fp8-aux"}))
    (dst / "topk.json").write_text(json.dumps({"k": k}))
    groups: dict[str, list[int]] = {}
    for i, e in enumerate(fs.entries):
        groups.setdefault(e["shard"], []).append(i)
    bar = progress(total=fs.n_tokens, desc="topk", unit="tok", unit_scale=True)
    for idx in groups.values():
        batch = []
        for i in idx:
            if fs.entries[i]["id"] in w.done:
                continue
            x = fs[i]
            with torch.no_grad():
                logp = torch.log_softmax((x["last_hidden_state"] @ W.T).float(), dim=-1)
                v, ids = logp.topk(k, dim=-1)
            v16 = v.half().float()
            hi = v16.bfloat16()
            packed = torch.zeros_like(x["last_hidden_state"])
            packed[:, :k] = hi
            packed[:, k : 2 * k] = (v16 - hi.float()).bfloat16()  # exact: fp16's 11 bits = 8 + 3
            packed[:, 2 * k : 3 * k] = (ids // 256).bfloat16()
            packed[:, 3 * k : 4 * k] = (ids % 256).bfloat16()
            batch.append((x["id"], {**x, "last_hidden_state": packed}))
            bar.update(len(x["input_ids"]))
        w.write_batch(batch)
    bar.close()


def patch_topk_teacher(k: int) -> None:
    """Teacher.targets from the packed top-K: probabilities renormalized over the draft vocabulary."""
    import torch

    from eaglenest.train import ttt

    def targets(self, last_hidden, chunk=None, argmax=None, mass=False, log_mass=None):
        h = last_hidden.float()
        logp = h[:, :k] + h[:, k : 2 * k]
        ids = (h[:, 2 * k : 3 * k] * 256 + h[:, 3 * k : 4 * k]).long()
        inv = self._w.get("inv")
        if inv is None:
            inv = self._w["inv"] = torch.full((self.t2d.numel(),), -1, dtype=torch.long)
            inv[self.draft_rows.long()] = torch.arange(self.draft_rows.numel())
        d = inv[ids]
        p = torch.zeros(h.shape[0], self.draft_rows.numel(), dtype=torch.float32)
        p.scatter_add_(1, d.clamp_min(0), torch.where(d >= 0, logp.exp(), torch.zeros_like(logp)))
        p /= p.sum(-1, keepdim=True).clamp_min(1e-30)
        from eaglenest.train.losses import TeacherRows

        # no full-vocabulary log-sum-exp in a top-K store: the evaluation's alpha is taken against the top-K
        return TeacherRows.from_probs(p, ids[:, 0], torch.zeros(p.shape[0]) if mass else None)

    ttt.Teacher.targets = targets


def variants(args) -> None:
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    bf16 = root / "bf16"
    if not bf16.exists():
        os.symlink(Path(args.bf16).resolve(), bf16)
    for d in ("fp8", "fp8-aux"):
        t = time.time()
        _cli(["features", "convert", str(bf16), "--store-dtype", d, "--out", str(root / d)])
        print(f"convert {d}: {time.time() - t:.0f} s", file=sys.stderr)
    build_topk(bf16, root / "topk")


def capture_speed(args) -> None:
    """End-to-end capture of the first N samples, bf16 vs fp8 store, interleaved A B A B (fresh stores)."""
    import torch

    from eaglenest.capture.run import run_capture
    from eaglenest.data import PreparedData
    from eaglenest.engines.hf import HFEngine

    torch.set_num_threads(args.threads)
    data = PreparedData(args.data)
    out = Path(args.root) / "capture_speed"
    res = {"bf16": [], "fp8": []}
    with HFEngine(_model(), device="cpu") as e:
        run_capture(e, data, out / "warm", dtype="bf16", limit=8)
        for r in range(args.repeats):
            for d in ("bf16", "fp8"):
                shutil.rmtree(out / d, ignore_errors=True)
                s = run_capture(e, data, out / d, dtype=d, limit=args.n)
                res[d].append({"tokens": s.tokens, "seconds": round(s.seconds, 2), "tokens_per_s": round(s.tokens / s.seconds, 1),
                               "bytes": s.bytes_written, "loadavg": [round(x, 2) for x in os.getloadavg()]})
    # the part that differs: encoding + writing the same captured samples, per store dtype, interleaved
    from eaglenest.features import FeatureStore, FeatureWriter

    src = FeatureStore(Path(args.root) / "bf16")
    samples = [(src.ids()[i], src[i]) for i in range(min(len(src), 256))]
    n_tok = sum(len(t["input_ids"]) for _, t in samples)
    write = {"bf16": [], "fp8": []}
    for r in range(args.repeats + 1):
        for d in ("bf16", "fp8"):
            shutil.rmtree(out / d, ignore_errors=True)
            w = FeatureWriter(out / d, src.meta.__class__.from_dict({**src.meta.to_dict(), "dtype": d}))
            t0, c0 = time.perf_counter(), time.process_time()
            for k in range(0, len(samples), 16):
                w.write_batch(samples[k : k + 16])
            if r:  # the first round warms up
                write[d].append({"tokens": n_tok, "cpu_s": round(time.process_time() - c0, 3), "wall_s": round(time.perf_counter() - t0, 3)})
    shutil.rmtree(out, ignore_errors=True)
    (Path(args.root) / "capture_speed.json").write_text(json.dumps(
        {"samples": args.n, "threads": args.threads, "runs": res,
         "store_write": {d: {"runs": v, "cpu_us_per_token": round(min(x["cpu_s"] for x in v) / n_tok * 1e6, 2)} for d, v in write.items()}},
        indent=2))


def train(args) -> None:
    import torch

    from eaglenest.demo import PRESETS

    torch.set_num_threads(args.threads)
    P = PRESETS["full"]
    feats, run = Path(args.root) / args.variant, Path(args.root) / "runs" / args.variant
    if (run / "final.json").exists():
        return
    if args.variant == "topk":
        patch_topk_teacher(json.loads((feats / "topk.json").read_text())["k"])
    argv = ["train", "--model", _model(), "--features", str(feats), "--out", str(run), "--ttt-steps", str(P["ttt_steps"]),
            "--draft-vocab", str(P["draft_vocab"]), "--lr", str(P["lr"]), "--epochs", str(P["epochs"]),
            "--batch-tokens", str(P["batch_tokens"]), "--device", "cpu", "--eval-fraction", "0.05", "--dtype", "bf16"]
    if args.max_steps:  # a smoke run of this script, not the measurement
        argv += ["--max-steps", str(args.max_steps)]
    if (run / "checkpoints" / "latest.json").exists():
        argv.append("--resume")
    t = time.time()
    _cli(argv)
    (run / "bench_wall.json").write_text(json.dumps({"wall_s": round(time.time() - t, 1), "threads": args.threads}))


def evaluate(args) -> None:
    import torch

    from eaglenest.demo import PRESETS

    torch.set_num_threads(args.threads)
    P = PRESETS["full"]
    run = Path(args.root) / "runs" / args.variant
    draft, report = run / "draft", run / f"mtbench_{args.limit}.json"
    if report.exists():
        return
    if not (draft / "config.json").exists():
        _cli(["export", "--run", str(run), "--out", str(draft), "--model", _model()])
    _cli(["eval", "--model", _model(), "--draft", str(draft), "--out", str(report), "--bench", "mtbench", "--limit", str(args.limit),
          "--steps", "3", "--topk", "1", "--temperature", "0", "--max-new-tokens", str(P["eval_max_new_tokens"]),
          "--device", "cpu", "--no-baseline", "--workers", "1"])


def mt(args) -> None:
    import tau_levers

    tau_levers.RUNS = Path(args.root) / "mt_proxy.jsonl"
    tau_levers.mt(argparse.Namespace(run=str(Path(args.root) / "runs" / args.variant), proxy=args.proxy, threads=args.threads,
                                     out_root=str(Path(args.root) / "mt_tmp")))


def report(args) -> None:
    import common
    from eaglenest.features import FeatureStore
    from eaglenest.features.store import bytes_per_token

    root = Path(args.root)
    out = {"kind": "store_dtype", "target": "SmolLM2-135M-Instruct (hidden 576)",
           "recipe": "the demo's full preset (1,500 ShareGPT conversations <= 512 tokens, TTT 3, draft vocab 8192, lr 1e-3, "
                     "1024-token batches, 2 epochs, bf16 autocast, seed 0), identical for every variant",
           "topk_k": TOPK, "variants": {}}
    proxy = {}
    if (root / "mt_proxy.jsonl").exists():
        for line in (root / "mt_proxy.jsonl").read_text().splitlines():
            r = json.loads(line)
            proxy[Path(r["run"]).name] = r
    for v in VARIANTS:
        if not (root / v).exists():
            continue
        fs = FeatureStore(root / v)
        H = fs.meta.hidden_size
        rec = {"bytes_per_token": topk_bytes_per_token(H) if v == "topk" else bytes_per_token(H, v),
               "bytes_on_disk_per_token": round(fs.bytes_on_disk() / fs.n_tokens, 1) if v != "topk" else None,
               "samples": len(fs), "tokens": fs.n_tokens}  # what the on-disk bytes were measured over
        run = root / "runs" / v
        if (run / "final.json").exists():
            ev = json.loads((run / "final.json").read_text())["eval"]
            last = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][-1]
            rec.update(heldout_acc=[round(a, 4) for a in ev["acc"]], steps=last["step"],
                       train_tokens_per_s=round(last["tokens_per_s"], 1), **json.loads((run / "bench_wall.json").read_text()))
        rep = run / f"mtbench_{args.limit}.json"
        if rep.exists():
            r = json.loads(rep.read_text())
            rec.update(tau=round(r["tau"], 4), accept_per_position=[round(a, 4) for a in r["accept_per_position"]],
                       generated_tokens=r["generated_tokens"], verify_steps=r["verify_steps"], n_prompts=r["n_prompts"])
        if v in proxy:
            rec.update(mt_proxy_acc=proxy[v]["mt_acc"], mt_proxy_expected_tau=proxy[v]["mt_expected_tau"])
        out["variants"][v] = rec
    V = out["variants"]
    for v in VARIANTS:
        key = v.replace("-", "_")
        if v in V:
            out[f"bytes_per_token_{key}"] = V[v]["bytes_per_token"]
            if "tau" in V[v]:
                out[f"tau_{key}"] = V[v]["tau"]
    if "tau_bf16" in out:
        for v in VARIANTS[1:]:
            key = v.replace("-", "_")
            if f"tau_{key}" in out:
                out[f"tau_delta_{key}_pct"] = round(100 * (out[f"tau_{key}"] - out["tau_bf16"]) / out["tau_bf16"], 2)
    if (root / "capture_speed.json").exists():
        cs = json.loads((root / "capture_speed.json").read_text())
        out["capture_speed"] = {**cs, "median_tokens_per_s": {d: sorted(r["tokens_per_s"] for r in runs)[len(runs) // 2] for d, runs in cs["runs"].items()}}
    out["bytes_per_token_kimi_k25_shape"] = {v: topk_bytes_per_token(7168) if v == "topk" else bytes_per_token(7168, v) for v in VARIANTS}
    out["goal"] = "|tau_fp8 - tau_bf16| <= 1% of tau_bf16, bytes/token <= 0.55x bf16"
    out["trained_variants"] = [v for v in V if "steps" in V[v]]
    out["decoded_variants"] = [v for v in V if "tau" in V[v]]  # tau is measured only for these
    if out["decoded_variants"]:
        out["eval"] = f"MT-bench first turns, questions 1-{args.limit}, 128 new tokens, 3 steps, topk 1, greedy, hf engine"
    common.write_result("store_dtype", out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("variants")
    p.add_argument("--bf16", required=True)
    p = sub.add_parser("capture-speed")
    p.add_argument("--data", required=True)
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    for name in ("train", "eval", "mt"):
        p = sub.add_parser(name)
        p.add_argument("variant", choices=VARIANTS)
        if name == "mt":
            p.add_argument("--proxy", required=True)
        if name == "train":
            p.add_argument("--max-steps", type=int, default=None, help="smoke runs only: cut the recipe short")
    p = sub.add_parser("report")
    for p in sub.choices.values():
        p.add_argument("--root", required=True)
        p.add_argument("--threads", type=int, default=1)
        p.add_argument("--limit", type=int, default=40, help="MT-bench questions decoded (eval, report)")
    a = ap.parse_args()
    {"variants": variants, "capture-speed": capture_speed, "train": train, "eval": evaluate, "mt": mt, "report": report}[a.cmd](a)


if __name__ == "__main__":
    main()
