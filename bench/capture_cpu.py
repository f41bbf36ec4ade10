"""Capture throughput vs a plain forward of the same model on the same batches (CPU or GPU).

    python bench/capture_cpu.py [--model smollm2] [--samples 96] [--max-length 512] [--batch-tokens 4096]

"plain" = the target's base model forward on the same padded batches with nothing kept;
"capture" = eaglenest's HF engine + writing the feature store (hooks, host copies, checksums,
safetensors, fsync).  Also reports bytes per token on disk.  Result: bench/results/capture_<device>.json
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402

from common import write_result  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    from eaglenest.capture.run import plan_batches, run_capture
    from eaglenest.data import PreparedData, prepare
    from eaglenest.engines.hf import HFEngine

    tmp = Path(tempfile.mkdtemp(prefix="eaglenest-bench-"))
    try:
        prepare(model=args.model, data=["sharegpt:"], out=tmp / "data", max_length=args.max_length, limit=args.samples, verbose=False)
        data = PreparedData(tmp / "data")
        engine = HFEngine(args.model, dtype=args.dtype, device="auto")
        lengths = [len(s.input_ids) for s in data]
        batches = plan_batches(lengths, args.batch_tokens)
        n_tok = sum(lengths)
        seqs = [[data[i].input_ids for i in b] for b in batches]

        @torch.inference_mode()
        def plain():
            for s in seqs:
                ids, att = engine._pad(s)
                engine.base(input_ids=ids, attention_mask=att, use_cache=False)
            if torch.cuda.is_available():
                torch.cuda.synchronize()

        plain()  # warm-up (allocator, kernels)
        t_plain, t_cap, bytes_written = [], [], 0
        for r in range(args.repeats):
            t = time.perf_counter()
            plain()
            t_plain.append(time.perf_counter() - t)
            out = tmp / f"feat{r}"
            t = time.perf_counter()
            s = run_capture(engine, data, out, dtype=args.dtype, batch_tokens=args.batch_tokens)
            t_cap.append(time.perf_counter() - t)
            bytes_written = s.bytes_written
        plain_tps, cap_tps = n_tok / min(t_plain), n_tok / min(t_cap)
        info = engine.info()
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        write_result(
            f"capture_{dev}",
            {
                "kind": "capture",
                "model": str(info.target),
                "hidden_size": info.hidden_size,
                "layer_ids": info.layer_ids,
                "dtype": args.dtype,
                "samples": len(data),
                "tokens": n_tok,
                "batches": len(batches),
                "batch_tokens": args.batch_tokens,
                "plain_forward_tokens_per_s": round(plain_tps, 1),
                "capture_tokens_per_s": round(cap_tps, 1),
                "ratio": round(cap_tps / plain_tps, 3),
                "bytes_per_token": round(bytes_written / n_tok, 1),
                "timings_s": {"plain": t_plain, "capture": t_cap},
            },
        )
        print(f"plain {plain_tps:.0f} tok/s, capture {cap_tps:.0f} tok/s ({cap_tps / plain_tps:.2f}x), {bytes_written / n_tok:.0f} B/token")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
