"""Capture speed on a GPU: plain prefill vs eaglenest's HF capture on an 8B-shaped random-init target.

    python bench/capture_gpu.py [--shape llama8b] [--samples 48] [--min-len 512] [--max-len 2048]
                                [--batch-tokens 16384] [--repeats 2] [--results-dir DIR]

Same padded batches (lengths drawn uniformly, planned like `eaglenest capture`), two ways:
  plain    the target's base model forward, nothing kept (the ceiling);
  capture  the product: HFEngine.capture_async driven as `eaglenest capture` drives it (batch i+1
           started before batch i is read): forward pre-hooks on the three aux layers + the final
           state, copied on a side stream into two reused pinned buffers, per-sample tensors.
Tokens/s over the best of --repeats passes after one warm-up pass.  The store write (disk) is
not included: it runs in `eaglenest capture` and depends on the disk, not the GPU.
Result: "kind": "capture" in bench/results/capture_gpu_<shape>.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from train_step import SHAPES  # noqa: E402  (one home for the benchmark shapes: hidden, heads, vocabulary, ...)

LAYERS = {"llama8b": 32, "tiny": 8}  # the target's depth (the training step's shapes are the draft's)


def random_target(shape: str, device: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    s = SHAPES[shape]
    cfg = LlamaConfig(hidden_size=s["H"], intermediate_size=s["I"], num_hidden_layers=LAYERS[shape], num_attention_heads=s["nh"],
                      num_key_value_heads=s["nkv"], head_dim=s["hd"], vocab_size=s["V"], max_position_embeddings=8192,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": s["theta"]})
    dt = torch.bfloat16 if device.startswith("cuda") else torch.float32
    old = torch.get_default_dtype()
    torch.set_default_dtype(dt)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():  # explicit init: never time on uninitialized memory
        for p in model.parameters():
            if p.ndim == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    return model.eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama8b", choices=sorted(LAYERS))
    ap.add_argument("--device", default="auto")
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--min-len", type=int, default=512)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--results-dir", default=None)
    a = ap.parse_args()

    import torch

    import common
    from eaglenest.capture.run import plan_batches
    from eaglenest.engines.base import Request
    from eaglenest.engines.hf import HFEngine

    if a.results_dir:
        common.RESULTS = Path(a.results_dir)
    dev = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = dev.startswith("cuda")
    t0 = time.perf_counter()
    model = random_target(a.shape, dev)
    engine = HFEngine(f"random-{a.shape}", model_obj=model, device=dev)
    setup_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    V = model.config.vocab_size
    lengths = torch.randint(a.min_len, a.max_len + 1, (a.samples,), generator=g).tolist()
    seqs = [torch.randint(3, V, (n,), generator=g).tolist() for n in lengths]
    batches = [[seqs[i] for i in b] for b in plan_batches(lengths, a.batch_tokens)]
    n_tok = sum(lengths)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    @torch.inference_mode()
    def plain():
        for b in batches:
            ids, att = engine._pad(b)
            engine.base(input_ids=ids, attention_mask=att, use_cache=False)
            engine._captured.clear()
        sync()

    def capture():
        kept, pending = 0, None
        for k, b in enumerate(batches):
            h = engine.capture_async([Request(f"{k}-{i}", s) for i, s in enumerate(b)])
            if pending is not None:
                kept += sum(r.aux_hidden_states.shape[0] for r in pending.result())
            pending = h
        kept += sum(r.aux_hidden_states.shape[0] for r in pending.result())
        sync()
        assert kept == n_tok

    runs = {"plain": plain, "capture": capture}
    for f in runs.values():  # warm-up: allocator, pinned host cache, kernels
        f()
    times = {k: [] for k in runs}
    for _ in range(a.repeats):
        for k, f in runs.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    tps = {k: n_tok / min(v) for k, v in times.items()}
    res = {
        "kind": "capture",
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "shape": a.shape,
        "target": f"random-init LlamaForCausalLM, {LAYERS[a.shape]} layers, " + ", ".join(f"{k}={v}" for k, v in SHAPES[a.shape].items()),
        "dtype": "bf16" if cuda else "fp32",
        "layer_ids": engine.layer_ids,
        "samples": a.samples,
        "tokens": n_tok,
        "batches": len(batches),
        "batch_tokens": a.batch_tokens,
        "plain_forward_tokens_per_s": round(tps["plain"], 1),
        "capture_tokens_per_s": round(tps["capture"], 1),
        "ratio": round(tps["capture"] / tps["plain"], 3),
        "goal": ">= 0.9x plain",  # the naive capture's rate was never recorded in a result file
        "timings_s": {k: [round(x, 3) for x in v] for k, v in times.items()},
        "setup_s": round(setup_s, 1),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
    }
    common.write_result(f"capture_{'gpu' if cuda else 'cpu'}_{a.shape}", res)
    print(f"plain {tps['plain']:.0f} tok/s, capture {tps['capture']:.0f} ({res['ratio']:.2f}x)")


if __name__ == "__main__":
    main()
