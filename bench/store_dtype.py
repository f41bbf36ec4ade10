"""What a compact feature store costs in bytes: the bf16 store and each compact variant, on disk.

    python bench/store_dtype.py variants --bf16 FEAT --root ROOT          # fp8, fp8-aux (features convert)
    python bench/store_dtype.py report --root ROOT                        # -> bench/results/store_dtype.json

Variants (same prepared data; only the stored states differ):
  bf16     the store as captured;
  fp8      aux and final states float8 e4m3, a power-of-two scale per block of at most 128 values;
  fp8-aux  aux states fp8, the final state (which feeds the teacher's logits) bf16.
A top-K teacher in place of the final state (aux in fp8, the target's top-32 ids + log-probs) was
measured beside them and not built: git show afe579c:bench/store_dtype.py.
What the fp8 store costs in tau was measured by the retired probe store_outliers (docs/benchmarks.md,
*Retired probes*); its script and results are in git history.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from arms import _cli  # noqa: E402  (bench/arms.py: `eaglenest ARGV` in this process)

VARIANTS = ("bf16", "fp8", "fp8-aux")


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


def report(args) -> None:
    import common
    from eaglenest.features import FeatureStore
    from eaglenest.features.store import bytes_per_token

    root = Path(args.root)
    out = {"kind": "store_dtype", "target": "SmolLM2-135M-Instruct (hidden 576)", "variants": {}}
    for v in VARIANTS:
        if not (root / v).exists():
            continue
        fs = FeatureStore(root / v)
        H = fs.meta.hidden_size
        out["variants"][v] = {"bytes_per_token": bytes_per_token(H, v), "bytes_on_disk_per_token": round(fs.bytes_on_disk() / fs.n_tokens, 1),
                              "samples": len(fs), "tokens": fs.n_tokens}  # what the on-disk bytes were measured over
        out[f"bytes_per_token_{v.replace('-', '_')}"] = out["variants"][v]["bytes_per_token"]
    out["bytes_per_token_kimi_k25_shape"] = {v: bytes_per_token(7168, v) for v in VARIANTS}
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
