"""SGLang 0.5.23 live on this CPU: the seed's path (raw ids -> /generate, states through the plugin)
against the hf engine, timed.

    python bench/sglang_live.py [--samples 16] [--dtype fp32] [--work DIR]

One `--sglang-serve` engine (SGLang's CPU engine, torch-native, plugin mode, started and stopped by
eaglenest) and the in-process hf engine capture the same prepared ShareGPT samples of SmolLM2 at
the default layers; per token, the cosine of every aux layer and of the final state; the server's
start-up time (first request answered), capture tokens/s of each engine, and greedy generation of
the same prompts by both (token equality).  Result: bench/results/sglang_live.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--work", default="/tmp/eaglenest-sglang-bench")
    a = ap.parse_args()

    import torch

    from common import write_result
    from eaglenest.cli import main as cli
    from eaglenest.engines.base import Captured, Generated, Request
    from eaglenest.engines.hf import HFEngine
    from eaglenest.engines.sglang.engine import SGLangEngine
    from eaglenest.models.fetch import fetch
    from eaglenest.data import PreparedData

    model = str(fetch("smollm2"))
    work = Path(a.work)
    data = work / "data"
    if not (data / "meta.json").exists():
        assert cli(["prepare", "--model", model, "--data", f"sharegpt:{4 * a.samples}", "--out", str(data), "--limit", str(a.samples),
                    "--max-length", "256"]) == 0
    samples = [PreparedData(data)[i] for i in range(a.samples)]
    reqs = [Request(s.id, list(s.input_ids)) for s in samples]
    n_tok = sum(len(r.input_ids) for r in reqs)

    t = time.time()
    with HFEngine(model, device="cpu", dtype=a.dtype) as hf:
        hf.capture(reqs[:1])  # warm-up
        t0 = time.time()
        ref = hf.capture(reqs)
        hf_s = time.time() - t0
        prompts = [Request(s.id, list(s.input_ids[:64])) for s in samples[:4]]
        hf_gen = hf.generate(prompts, a.max_new_tokens)
    print(f"hf: {time.time() - t:.0f} s", file=sys.stderr)

    t = time.time()
    eng = SGLangEngine(model, serve=True, dtype=a.dtype)
    try:
        eng.capture(reqs[:1])  # starts the server: first request answered
        start_s = time.time() - t
        t0 = time.time()
        got = eng.capture(reqs)
        sgl_s = time.time() - t0
        sgl_gen = eng.generate(prompts, a.max_new_tokens)
        stats = eng.request_stats()
        versions = dict(eng.server_versions)
    finally:
        eng.close()

    cos = {"aux": [], "final": []}
    failures = []
    for r, g in zip(ref, got):
        if not (isinstance(r, Captured) and isinstance(g, Captured)):
            failures.append(getattr(g, "reason", None) or getattr(r, "reason", None))
            continue
        c = torch.nn.functional.cosine_similarity
        H = r.last_hidden_state.shape[-1]
        for k in range(r.aux_hidden_states.shape[-1] // H):
            x, y = r.aux_hidden_states[:, k * H:(k + 1) * H].float(), g.aux_hidden_states[:, k * H:(k + 1) * H].float()
            cos["aux"].append(float(c(x, y, dim=-1).min()))
        cos["final"].append(float(c(r.last_hidden_state.float(), g.last_hidden_state.float(), dim=-1).min()))
    same = [isinstance(x, Generated) and isinstance(y, Generated) and x.output_ids == y.output_ids for x, y in zip(hf_gen, sgl_gen)]
    write_result("sglang_live", {
        "kind": "sglang_live",
        "what": "SGLang 0.5.23 CPU engine (torch-native, eaglenest plugin) vs the hf engine on SmolLM2-135M-Instruct",
        "dtype": a.dtype, "samples": a.samples, "tokens": n_tok, "failures": failures,
        "server_start_to_first_answer_s": round(start_s, 1),
        "capture_tokens_per_s": {"sglang_plugin": round(n_tok / sgl_s, 1), "hf": round(n_tok / hf_s, 1)},
        "min_token_cosine": {"aux_layers": round(min(cos["aux"]), 7), "final_state": round(min(cos["final"]), 7)},
        "greedy_equal_prompts": f"{sum(same)}/{len(same)} (first 64 prompt tokens, {a.max_new_tokens} new tokens)",
        "client_requests": {k: v for k, v in (stats or {}).items() if k != "records"},
        "server_versions": versions,
        "note": "shared 2-core machine: speeds are indicative; the cosines and equality do not depend on load",
    })


if __name__ == "__main__":
    main()
