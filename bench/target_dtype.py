"""What the target's dtype costs on this CPU: a SmolLM2 prefill (what capture runs) and batch-1
decoding forwards of 1 and 4 new tokens (what eval runs), bf16 vs fp32, each arm a fresh process,
alternating rounds.  Behind `--dtype auto` (utils.auto_dtype): a CPU without bf16 matrix
instructions (AMX / AVX512-BF16) runs bf16 through emulated kernels.

    python bench/target_dtype.py [--rounds 2]   # -> bench/results/target_dtype_cpu_<bf16|no-bf16>.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import child_result, write_result  # noqa: E402

PREFILL = (4, 512)  # [batch, tokens]: 2,048 tokens, a capture batch of the demo's size
CONTEXT = 256  # decoding forwards extend a 256-token cache
REPS = 12


def child(dtype: str) -> dict:
    import torch

    from eaglenest.models.target import load_target

    torch.manual_seed(0)
    m = load_target("smollm2", dtype, "cpu", False)
    ids = torch.randint(100, 40000, PREFILL)
    out = {}
    with torch.no_grad():
        m.model(ids[:1, :64])  # one-time kernel set-up, not timed
        times = []
        for _ in range(2):
            t = time.perf_counter()
            m.model(ids)
            times.append(time.perf_counter() - t)
        out["prefill_s"] = times
        out["prefill_tokens_per_s"] = round(ids.numel() / min(times), 1)
        ctx = torch.randint(100, 40000, (1, CONTEXT))
        for rows in (1, 4):
            times = []
            for r in range(REPS + 1):
                cache = m(ctx, use_cache=True).past_key_values
                new = torch.randint(100, 40000, (1, rows))
                t = time.perf_counter()
                m(new, past_key_values=cache, use_cache=True)
                if r:  # the first is a warm-up
                    times.append(time.perf_counter() - t)
            out[f"decode_{rows}_ms"] = round(1e3 * statistics.median(times), 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print("RESULT " + json.dumps(child(a.child)), flush=True)
        return
    from eaglenest.utils import auto_dtype, cpu_has_fast_bf16

    runs = []
    for r in range(a.rounds):
        for dtype in ("bf16", "fp32") if r % 2 == 0 else ("fp32", "bf16"):
            res = child_result([sys.executable, __file__, "--child", dtype])
            res.update(dtype=dtype, round=r)
            print(json.dumps(res), flush=True)
            runs.append(res)
    summary = {}
    for dtype in ("bf16", "fp32"):
        rs = [x for x in runs if x["dtype"] == dtype and "error" not in x]
        if rs:
            summary[dtype] = {k: round(statistics.mean(x[k] for x in rs), 2)
                              for k in ("prefill_tokens_per_s", "decode_1_ms", "decode_4_ms")}
    fast = cpu_has_fast_bf16()
    if len(summary) == 2:
        summary["fp32_over_bf16_prefill"] = round(summary["fp32"]["prefill_tokens_per_s"] / summary["bf16"]["prefill_tokens_per_s"], 2)
        summary["bf16_over_fp32_decode_1"] = round(summary["bf16"]["decode_1_ms"] / summary["fp32"]["decode_1_ms"], 2)
    write_result(f"target_dtype_cpu_{'bf16' if fast else 'no-bf16'}", {
        "kind": "target_dtype", "model": "smollm2", "prefill_shape": list(PREFILL), "decode_context": CONTEXT,
        "decode_reps": REPS, "bf16_matrix_instructions": fast, "auto_dtype": auto_dtype("auto", "cpu")[0],
        "runs": runs, "summary": summary,
    })


if __name__ == "__main__":
    main()
