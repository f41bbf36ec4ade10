"""What a compact feature store costs in bytes: the bf16 store and each compact variant, on disk.

    python bench/store_dtype.py variants --bf16 FEAT --root ROOT          # fp8, fp8-aux (convert) and topk (below)
    python bench/store_dtype.py report --root ROOT                        # -> bench/results/store_dtype.json

Variants (same prepared data; only the stored states differ):
  bf16     the store as captured;
  fp8      aux and final states float8 e4m3, a power-of-two scale per token and per layer;
  fp8-aux  aux states fp8, the final state (which feeds the teacher's logits) bf16;
  topk     aux states fp8, and instead of the final state the target's top-K log-probabilities
           (K=32: int32 ids + fp16 log-probs, 192 B/token), i.e. the teacher itself.  Not a store
           dtype: its bytes/token are those of the layout, computed (the K ids and log-probs are
           packed into the first 4K columns of a stored final state to check the layout round-trips).
What the fp8 store costs in tau was measured by the retired probe store_outliers (docs/benchmarks.md,
*Retired probes*); its script and results are in git history.
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


def report(args) -> None:
    import common
    from eaglenest.features import FeatureStore
    from eaglenest.features.store import bytes_per_token

    root = Path(args.root)
    out = {"kind": "store_dtype", "target": "SmolLM2-135M-Instruct (hidden 576)",
           "topk_k": TOPK, "variants": {}}
    for v in VARIANTS:
        if not (root / v).exists():
            continue
        fs = FeatureStore(root / v)
        H = fs.meta.hidden_size
        out["variants"][v] = {"bytes_per_token": topk_bytes_per_token(H) if v == "topk" else bytes_per_token(H, v),
                              "bytes_on_disk_per_token": round(fs.bytes_on_disk() / fs.n_tokens, 1) if v != "topk" else None,
                              "samples": len(fs), "tokens": fs.n_tokens}  # what the on-disk bytes were measured over
        out[f"bytes_per_token_{v.replace('-', '_')}"] = out["variants"][v]["bytes_per_token"]
    out["bytes_per_token_kimi_k25_shape"] = {v: topk_bytes_per_token(7168) if v == "topk" else bytes_per_token(7168, v) for v in VARIANTS}
    out["goal"] = "bytes/token <= 0.55x bf16"
    common.write_result("store_dtype", out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("variants").add_argument("--bf16", required=True)
    sub.add_parser("report")
    for p in sub.choices.values():
        p.add_argument("--root", required=True)
    a = ap.parse_args()
    {"variants": variants, "report": report}[a.cmd](a)


if __name__ == "__main__":
    main()
