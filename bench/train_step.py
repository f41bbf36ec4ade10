"""One EAGLE-3 training step (TTT 7), eaglenest vs SpecForge 0.2.0, on the same inputs.

    python bench/train_step.py --impl both --shape llama8b --seq 2048,8192,32768 --steps 3 --warmup 1
    python bench/train_step.py --impl ours --shape smollm2 --seq 512,1024 --device cpu --compare-eager

Each (implementation, length) runs in a FRESH subprocess (leftovers from one would inflate the
other's peak), with a timeout; out-of-memory and crashes are recorded as the reason.  Inputs are a
pure function of (shape, seq, seed) -- random features of the real shapes, token ids drawn from a
Zipf law over a permuted vocabulary, a draft vocabulary built from those frequencies (as
`eaglenest train` does), a chat-like loss mask (~2/3 assistant tokens) and a final hidden state
whose teacher puts ~0.85 on the next token -- generated on the device from a seeded generator, so
both implementations see identical tensors.

  ours:      Teacher.targets (draft-vocab probabilities + chunked full-vocab argmax, bf16 matmuls on
             CUDA) -> ttt_forward (fast attention, chunked+checkpointed logits, optional per-step
             recompute) -> backward -> clip -> AdamW on fp32 params under bf16 autocast (= the trainer).
  specforge: LlamaForCausalLMEagle3 (bf16) + OnlineEagle3Model(flex_attention) with the compact
             teacher from (final hidden, lm_head) -> sum 0.8^i plosses -> backward -> BF16Optimizer
             (fp32 masters, clip 0.5).  Needs `specforge` importable (its wheel, --no-deps) and triton.

Timing: median of --steps steps after --warmup, each synchronized; tokens/s = seq / median.
Peak memory: torch.cuda.max_memory_allocated over the whole process on GPU; on CPU the process's
max RSS (resource.getrusage; includes the interpreter/torch baseline, reported separately).
Results: bench/results/train_step_<device>_<shape>_<seq>.json (or --results-dir).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

SHAPES = {
    # hidden, heads, kv heads, head dim, intermediate, target vocab, draft vocab, rope theta
    "llama8b": dict(H=4096, nh=32, nkv=8, hd=128, I=14336, V=128256, Vd=32000, theta=500000.0),
    "smollm2": dict(H=576, nh=9, nkv=3, hd=64, I=1536, V=49152, Vd=32000, theta=100000.0),
    "tiny": dict(H=64, nh=4, nkv=2, hd=16, I=128, V=1000, Vd=500, theta=10000.0),
}


# --- the FLOP model (see bench/NOTES.md) -----------------------------------------------------
def model_flops_per_token(shape: str, T: int, ttt: int) -> float:
    """Model FLOPs of one step per token (fwd + bwd, no recompute, logits over every position):
    fc 4P (no input grad), per TTT step 6 (P_layer + P_lm_head) + causal attention 6 T nh hd,
    teacher 2 H (V + Vd) forward only."""
    s = SHAPES[shape]
    H, I, nh, nkv, hd, V, Vd = s["H"], s["I"], s["nh"], s["nkv"], s["hd"], s["V"], s["Vd"]
    p_fc = 3 * H * H
    p_layer = 2 * H * (nh + 2 * nkv) * hd + nh * hd * H + 3 * H * I
    p_lm = H * Vd
    return 4 * p_fc + ttt * (6 * (p_layer + p_lm) + 6 * T * nh * hd) + 2 * H * (V + Vd)


# --- inputs ------------------------------------------------------------------------------------
def make_inputs(shape: str, T: int, device: str, seed: int = 0):
    """Identical tensors in any process on the same device type (seeded generators)."""
    import torch

    from eaglenest.draft.vocab import build_vocab

    s = SHAPES[shape]
    H, V, Vd = s["H"], s["V"], s["Vd"]
    g = torch.Generator().manual_seed(seed)
    # Zipf(1.1) token frequencies over a permuted vocabulary; the draft vocab = the Vd most frequent
    perm = torch.randperm(V, generator=g)
    probs = torch.empty(V, dtype=torch.float64)
    probs[perm] = 1.0 / torch.arange(1, V + 1, dtype=torch.float64) ** 1.1
    probs /= probs.sum()
    counts = (probs * 1e9).long()
    d2t, t2d = build_vocab(counts, Vd)
    ids = torch.multinomial(probs, T + 1, replacement=True, generator=g)
    # chat-like loss mask: prompt segments (0) of 32-256 tokens, answers (1) of 64-512 tokens
    mask = torch.zeros(T, dtype=torch.long)
    t, on = 0, False
    while t < T:
        n = int(torch.randint(64, 513, (1,), generator=g)) if on else min(max(1, T // 8), int(torch.randint(32, 257, (1,), generator=g)))
        mask[t : t + n] = int(on)
        t, on = t + n, not on
    gd = torch.Generator(device=device).manual_seed(seed + 1)
    bf = torch.bfloat16
    W = (torch.randn(V, H, generator=gd, device=device, dtype=torch.float32) / math.sqrt(H)).to(bf)  # target lm_head
    embed = (torch.randn(V, H, generator=gd, device=device, dtype=torch.float32) * 0.02).to(bf)
    aux = torch.randn(1, T, 3 * H, generator=gd, device=device, dtype=bf)
    # final (post-norm) state: logit(next) ~ 14 + N(0,1), others ~ N(0,1): top-1 p ~ 0.85 at V = 128K
    nxt = ids[1:].to(device)
    last = (14.0 * W[nxt].float() + torch.randn(T, H, generator=gd, device=device)).to(bf)[None]
    return dict(
        input_ids=ids[:T][None].to(device), loss_mask=mask[None].to(device), aux=aux, last=last,
        lm_head=W, embed=embed, d2t=d2t.to(device), t2d=t2d.to(device),
    )


# --- one implementation in this process --------------------------------------------------------
def build_ours(shape, T, ttt, device, inp, attn_impl, recompute, chunk, checkpoint_logits):
    import torch

    from eaglenest.draft.model import DraftConfig, Eagle3Draft
    from eaglenest.draft.vocab import draft_ids_to_target
    from eaglenest.train.ttt import Teacher, denominators, ttt_forward

    s = SHAPES[shape]
    cuda = device.startswith("cuda")
    cfg = DraftConfig(
        hidden_size=s["H"], intermediate_size=s["I"], num_attention_heads=s["nh"], num_key_value_heads=s["nkv"],
        head_dim=s["hd"], vocab_size=s["V"], draft_vocab_size=s["Vd"], target_hidden_size=s["H"],
        aux_layer_ids=[1, 2, 3], target_num_layers=32, max_position_embeddings=max(8192, T + ttt),
        rope_parameters={"rope_type": "default", "rope_theta": s["theta"]},
    )
    rows = draft_ids_to_target(inp["d2t"].cpu()).to(device)
    with torch.device(device):
        torch.manual_seed(0)
        model = Eagle3Draft(cfg, embed_weight=inp["embed"].float())  # fp32 params + fp32 embed, as the trainer
        with torch.no_grad():
            for mod in model.modules():
                if isinstance(mod, torch.nn.Linear):
                    mod.weight.normal_(std=0.02)
            model.lm_head.weight.copy_(inp["lm_head"].float()[rows])  # --init-head target
    model.set_vocab(inp["d2t"], inp["t2d"])
    teacher = Teacher(None, 1e-5, inp["lm_head"] if cuda else inp["lm_head"].float(), rows, inp["t2d"],
                      matmul_dtype=torch.bfloat16 if cuda else torch.float32)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0)
    ids, mask = inp["input_ids"], inp["loss_mask"]
    aux = inp["aux"] if cuda else inp["aux"].float()
    last = inp["last"]
    denom = denominators(mask, ttt)
    H = s["H"]
    from eaglenest.draft.kernels import causal_kernel

    kernel = causal_kernel(attn_impl)  # one kernel for the run, as the trainer holds it (flex compiles once)

    def step():
        opt.zero_grad(set_to_none=True)
        trows = teacher.targets(last.reshape(-1, H))
        with torch.autocast("cuda" if cuda else "cpu", dtype=torch.bfloat16, enabled=cuda):
            loss, _ = ttt_forward(model, ids, aux, trows, mask, ttt, denom,
                                  chunk=chunk, checkpoint_logits=checkpoint_logits, attn_impl=kernel, recompute=recompute)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        return float(loss.detach())

    return step


def build_specforge(shape, T, ttt, device, inp, attn_backend="flex_attention"):
    import torch
    from transformers import LlamaConfig

    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.optimizer import BF16Optimizer
    from specforge.utils import padding

    s = SHAPES[shape]
    cfg = LlamaConfig(
        hidden_size=s["H"], intermediate_size=s["I"], num_attention_heads=s["nh"], num_key_value_heads=s["nkv"],
        head_dim=s["hd"], vocab_size=s["V"], num_hidden_layers=1, max_position_embeddings=max(8192, T + ttt + 64),
        rms_norm_eps=1e-5, hidden_act="silu", pretraining_tp=1, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": s["theta"]},
    )
    cfg.draft_vocab_size = s["Vd"]
    cfg.target_hidden_size = s["H"]
    with torch.device(device):
        torch.manual_seed(0)
        draft = LlamaForCausalLMEagle3(cfg, attention_backend=attn_backend)
    draft = draft.to(device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(inp["embed"])
        draft.t2d.copy_(inp["t2d"])
        draft.d2t.copy_(inp["d2t"])
        rows = torch.nonzero(inp["t2d"]).flatten()
        draft.lm_head.weight.copy_(inp["lm_head"][rows])
    draft.embed_tokens.weight.requires_grad_(False)  # frozen target embeddings (as SpecForge trains)
    model = OnlineEagle3Model(draft, length=ttt, attention_backend=attn_backend)
    opt = BF16Optimizer(draft, lr=1e-4, max_grad_norm=0.5, total_steps=1000)
    # TargetHead.preprocess: inputs and teacher states shifted left by one, loss mask [B, T, 1]
    input_ids = padding(inp["input_ids"], left=False)
    target_hidden = padding(inp["last"], left=False)
    loss_mask = inp["loss_mask"][..., None]
    attention_mask = torch.ones_like(inp["input_ids"])
    aux = inp["aux"]
    W = inp["lm_head"]

    def step():
        plosses, *_ = model(
            input_ids=input_ids, attention_mask=attention_mask, target=None, loss_mask=loss_mask,
            hidden_states=aux, target_hidden_for_compact=target_hidden, target_head_weight=W,
        )
        loss = sum(0.8**i * p for i, p in enumerate(plosses))
        loss.backward()
        opt.step()  # clip, AdamW on the fp32 masters, copy back, zero grads
        return float(loss.detach())

    return step


def saved_bytes(a) -> dict:
    """Autograd-saved bytes per token per TTT step of our loss (bf16 autocast, checkpointed logits),
    measured with saved_tensors_hooks (storages counted once, parameters and their bf16 casts
    excluded by differencing): S(T, k) at two lengths and two TTT depths ->
    per token per step = [(S(T2,k2) - S(T1,k2)) - (S(T2,k1) - S(T1,k1))] / (T2 - T1) / (k2 - k1)."""
    import torch

    from eaglenest.train.ttt import denominators, ttt_forward

    T1, T2, k1, k2 = 32, 64, 1, 3
    inp = make_inputs(a.shape, T2, "cpu")
    s = SHAPES[a.shape]
    out = {}
    for rec in (False, True):
        S = {}
        for T in (T1, T2):
            for k in (k1, k2):
                step_inp = {**inp, "input_ids": inp["input_ids"][:, :T], "loss_mask": torch.ones(1, T, dtype=torch.long),
                            "aux": inp["aux"][:, :T].float()}
                model = _SAVED_MODEL.get(a.shape) or _SAVED_MODEL.setdefault(a.shape, _bare_model(a.shape, inp))
                seen = {}

                def pack(t):
                    st = t.untyped_storage()
                    seen[st.data_ptr()] = st.nbytes()
                    return t

                from eaglenest.train.losses import TeacherRows

                tl = TeacherRows(torch.log_softmax(torch.randn(T, s["Vd"]), -1), torch.zeros(T, dtype=torch.long))
                m = step_inp["loss_mask"]
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
                    ttt_forward(model, step_inp["input_ids"], step_inp["aux"], tl, m, k, denominators(m, k),
                                chunk=16, checkpoint_logits=True, attn_impl="chunked", recompute=rec)
                S[(T, k)] = sum(v for p, v in seen.items() if p != tl.logits.untyped_storage().data_ptr())
        per = ((S[(T2, k2)] - S[(T1, k2)]) - (S[(T2, k1)] - S[(T1, k1)])) / (T2 - T1) / (k2 - k1)
        fixed = (S[(T2, k1)] - S[(T1, k1)]) / (T2 - T1) - per  # per token, outside the TTT steps (fc, inputs)
        out["layer_recompute" if rec else "no_recompute"] = {"bytes_per_token_per_step": round(per), "bytes_per_token_fixed": round(fixed)}
    H, I = s["H"], s["I"]
    out["model_no_recompute"] = 47 * H + 8 * I  # eaglenest.train.trainer.estimate_activation_bytes per token per step
    return out


_SAVED_MODEL: dict = {}


def _bare_model(shape, inp):
    import torch

    from eaglenest.draft.model import DraftConfig, Eagle3Draft

    s = SHAPES[shape]
    cfg = DraftConfig(
        hidden_size=s["H"], intermediate_size=s["I"], num_attention_heads=s["nh"], num_key_value_heads=s["nkv"],
        head_dim=s["hd"], vocab_size=s["V"], draft_vocab_size=s["Vd"], target_hidden_size=s["H"],
        aux_layer_ids=[1, 2, 3], target_num_layers=32, rope_parameters={"rope_type": "default", "rope_theta": s["theta"]},
    )
    torch.manual_seed(0)
    m = Eagle3Draft(cfg, embed_weight=inp["embed"].float())
    m.set_vocab(inp["d2t"], inp["t2d"])
    return m


def rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def worker(a) -> dict:
    """Runs in the fresh subprocess: build, warm up, time; never raises (the reason goes in the JSON)."""
    import torch

    dev = a.device
    cuda = dev.startswith("cuda")
    out: dict = {"impl": a.worker, "seq": a.seq}
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        t0 = time.perf_counter()
        inp = make_inputs(a.shape, a.seq, dev)
        if a.worker == "specforge":
            step = build_specforge(a.shape, a.seq, a.ttt, dev, inp)
            import specforge

            out["specforge_version"] = getattr(specforge, "__version__", None) or _dist_version("specforge")
            out["attn"] = "flex_attention (SpecForge's compiled flex + eagle3 block mask)"
        else:
            attn = a.attn_impl
            rec = {"auto": None, "none": False, "layer": True}[a.recompute]
            if rec is None:  # the trainer's rule: recompute when activations would not fit in half the free memory
                from eaglenest.train.trainer import estimate_activation_bytes

                s = SHAPES[a.shape]
                est = estimate_activation_bytes(type("C", (), {"hidden_size": s["H"], "intermediate_size": s["I"]})(), a.seq, a.ttt)
                rec = bool(cuda and est > 0.5 * torch.cuda.mem_get_info()[0])
            from eaglenest.train.objective import logits_checkpoint

            ckpt = logits_checkpoint(a.logits_checkpoint, dev)  # the trainer's rule
            out.update(attn=attn, recompute=rec, logits_chunk=a.logits_chunk, logits_checkpoint=ckpt)
            step = build_ours(a.shape, a.seq, a.ttt, dev, inp, attn, rec, a.logits_chunk, ckpt)
        del inp
        out["setup_s"] = round(time.perf_counter() - t0, 1)
        out["rss_after_setup_gib"] = round(rss_gib(), 3)
        if cuda:  # the peak of the training steps (all resident state included), not of input generation
            torch.cuda.synchronize()
            out["allocated_after_setup_gib"] = round(torch.cuda.memory_allocated() / 2**30, 3)
            torch.cuda.reset_peak_memory_stats()
        times, losses = [], []
        i = 0
        while i < a.warmup + a.steps:
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            failed = None
            try:
                losses.append(step())
            except Exception as e:
                if not (i == 0 and a.worker == "ours" and out.get("attn") == "flex" and "out of memory" not in str(e).lower()):
                    raise
                failed = f"flex failed ({type(e).__name__}: {str(e)[:300]}); chunked instead"
            if failed:  # outside the except block: no traceback keeps the first model alive
                import gc

                out["fallback"], out["attn"] = failed, "chunked"
                step = None
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
                step = build_ours(a.shape, a.seq, a.ttt, dev, make_inputs(a.shape, a.seq, dev), "chunked", out["recompute"], a.logits_chunk,
                                  out["logits_checkpoint"])
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                continue
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            print(f"[{a.worker} seq {a.seq}] step {i}: {times[-1]:.3f}s loss {losses[-1]:.4f}", file=sys.stderr, flush=True)
            i += 1
        meas = sorted(times[a.warmup :])
        med = meas[len(meas) // 2] if len(meas) % 2 else 0.5 * (meas[len(meas) // 2 - 1] + meas[len(meas) // 2])
        out.update(
            step_s_median=round(med, 4), step_s_all=[round(x, 4) for x in times], warmup=a.warmup,
            tokens_per_s=round(a.seq / med, 1), losses=[round(x, 5) for x in losses],
            model_tflops=round(model_flops_per_token(a.shape, a.seq, a.ttt) * a.seq / med / 1e12, 2),
        )
    except Exception as e:  # OOM, import errors, compile failures: recorded, not raised
        msg = f"{type(e).__name__}: {str(e)[:800]}"
        out["error"] = "out of memory" if "out of memory" in msg.lower() or "OutOfMemory" in msg else msg
        out["traceback"] = traceback.format_exc()[-2000:]
    if cuda:
        out["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
        out["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 3)
        out["peak_kind"] = "torch.cuda.max_memory_allocated over the training steps (all resident state included; input generation excluded)"
    else:
        out["peak_gib"] = round(rss_gib(), 3)
        out["peak_kind"] = "max RSS of the process (resource.getrusage; includes ~the interpreter+torch baseline)"
        out["baseline_rss_gib"] = a.baseline_rss
    return out


def _dist_version(name):
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None


def versions() -> dict:
    v = {"python": sys.version.split()[0]}
    for n in ("torch", "transformers", "triton", "specforge", "eaglenest"):
        v[n] = _dist_version(n)
    return v


# --- the parent: one subprocess per (impl, seq) ------------------------------------------------
def run_child(a, impl: str, seq: int, attn_impl: str, timeout: float) -> dict:
    if a.budget:
        timeout = min(timeout, a.t_start + a.budget - time.perf_counter() - 5)
        if timeout < 20:
            return {"error": "not run: no time left in this invocation's --budget"}
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", impl, "--json-out", path, "--shape", a.shape,
           "--seq", str(seq), "--ttt", str(a.ttt), "--device", a.device, "--steps", str(a.steps), "--warmup", str(a.warmup),
           "--attn-impl", attn_impl, "--recompute", a.recompute, "--logits-chunk", str(a.logits_chunk),
           "--logits-checkpoint", a.logits_checkpoint,
           "--baseline-rss", str(a.baseline_rss), "--threads", str(a.threads)]
    t = time.perf_counter()
    try:
        r = subprocess.run(cmd, timeout=timeout, capture_output=True, text=True)
        res = json.loads(Path(path).read_text()) if Path(path).stat().st_size else {}
        if r.returncode != 0 and "error" not in res:
            tail = (r.stderr or "")[-1500:]
            res["error"] = "out of memory (killed)" if r.returncode in (-9, 137) else f"exit {r.returncode}: {tail}"
        sys.stderr.write(r.stderr[-4000:])
    except subprocess.TimeoutExpired:
        res = {"error": f"timed out after {timeout:.0f}s (compile + warm-up + steps)"}
    finally:
        Path(path).unlink(missing_ok=True)
    res["wall_s"] = round(time.perf_counter() - t, 1)
    return res


def summary(r: dict) -> dict:
    if "error" in r:
        return {"reason": r["error"], **{k: r[k] for k in ("peak_gib",) if k in r}}
    return {"tokens_per_s": r["tokens_per_s"], "peak_gib": r["peak_gib"], "step_s": r["step_s_median"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", default="both", choices=["ours", "specforge", "both"])
    ap.add_argument("--seq", default="2048")
    ap.add_argument("--shape", default="llama8b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="auto")
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--attn-impl", default="auto", help="ours: flex (CUDA default) | sdpa (CPU bf16 default) | chunked | eager")
    ap.add_argument("--recompute", default="auto", choices=["auto", "none", "layer"])
    ap.add_argument("--logits-chunk", type=int, default=0, help="0: 4096 on CUDA, 1024 on CPU")
    ap.add_argument("--logits-checkpoint", default="auto", choices=["auto", "on", "off"],
                    help="ours: recompute the draft logits in backward (auto: on CUDA, as the trainer); a run with "
                         "on/off writes train_step_..._logits-<on|off>.json")
    ap.add_argument("--compare-eager", action="store_true", help="also run ours with attn eager (the reference path)")
    ap.add_argument("--specforge-max-seq", type=int, default=49152,
                    help="skip SpecForge above this length (anchor: OOM at 65536 on an H200); the skip is recorded")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads in the workers (0: torch's default)")
    ap.add_argument("--timeout", type=float, default=600, help="per subprocess (ours), seconds")
    ap.add_argument("--timeout-specforge", type=float, default=None, help="per SpecForge subprocess (default: --timeout); its first step compiles 7 block masks")
    ap.add_argument("--budget", type=float, default=float(os.environ.get("BENCH_BUDGET_S", 0)) or None,
                    help="seconds for this whole invocation (default $BENCH_BUDGET_S): child timeouts shrink to fit")
    ap.add_argument("--results-dir", default=None)
    ap.add_argument("--saved-bytes", action="store_true", help="only measure autograd-saved bytes per token per TTT step (CPU) and print them")
    ap.add_argument("--name", default=None, help="result file stem (default train_step_<device>_<shape>_<seq>)")
    # worker-only
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--baseline-rss", type=float, default=0.0, help=argparse.SUPPRESS)
    a = ap.parse_args()

    if a.device == "auto":
        import torch

        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = a.device.startswith("cuda")
    if a.attn_impl == "auto":
        a.attn_impl = "flex" if cuda else "chunked"
    if not a.logits_chunk:
        a.logits_chunk = 4096 if cuda else 1024

    if a.saved_bytes:
        print(json.dumps({"shape": a.shape, **saved_bytes(a)}))
        return
    if a.worker:
        if a.threads:
            import torch

            torch.set_num_threads(a.threads)
        a.seq = int(a.seq)
        res = worker(a)
        Path(a.json_out).write_text(json.dumps(res))
        return

    import common

    if a.results_dir:
        common.RESULTS = Path(a.results_dir)
    # the interpreter + torch + eaglenest baseline RSS of a worker (CPU peaks are reported against it)
    if not cuda:
        r = subprocess.run([sys.executable, "-c", "import resource, torch, eaglenest.train.ttt, transformers;"
                            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)"], capture_output=True, text=True)
        a.baseline_rss = round(float(r.stdout.strip() or 0), 3)
    a.t_start = time.perf_counter()
    machine = common.machine()
    for seq in [int(x) for x in a.seq.split(",") if x]:
        result = {
            "kind": "train_step", "device": machine["device"], "seq": seq, "ttt": a.ttt, "shape": a.shape,
            "batch": 1, "steps": a.steps, "warmup": a.warmup, "shape_dims": SHAPES[a.shape], "torch_threads": a.threads or None,
            "model_gflop_per_token": round(model_flops_per_token(a.shape, seq, a.ttt) / 1e9, 3),
            "versions": versions(),
        }
        dev = "cuda" if cuda else "cpu"
        name = a.name.format(seq=seq) if a.name else f"train_step_{dev}_{a.shape}_{seq}"
        if a.logits_checkpoint != "auto" and not a.name:
            name += f"_logits-{a.logits_checkpoint}"
        if a.impl in ("ours", "both"):
            r = run_child(a, "ours", seq, a.attn_impl, a.timeout)
            result["ours"], result["ours_detail"] = summary(r), r
            if a.compare_eager:
                r = run_child(a, "ours", seq, "eager", a.timeout)
                result["ours_eager"], result["ours_eager_detail"] = summary(r), r
            if a.impl == "both":
                common.write_result(name, dict(result))  # partial: survives a cut-short SpecForge run
        if a.impl in ("specforge", "both"):
            if cuda and seq > a.specforge_max_seq:
                result["specforge"] = {"reason": f"not run above {a.specforge_max_seq} tokens: out of memory at 65536 on an H200 in the anchor run (SpecForge flex, ~2 GiB per 1K tokens)"}
            elif not cuda:
                result["specforge"] = {"reason": "not run: SpecForge 0.2.0 needs CUDA (triton kernels in its loss; flex attention has no CPU backward)"}
            else:
                r = run_child(a, "specforge", seq, "flex", a.timeout_specforge or a.timeout)
                result["specforge"], result["specforge_detail"] = summary(r), r
        if "tokens_per_s" in result.get("ours", {}) and "tokens_per_s" in result.get("specforge", {}):
            result["speedup"] = round(result["ours"]["tokens_per_s"] / result["specforge"]["tokens_per_s"], 3)
            result["memory_ratio"] = round(result["ours"]["peak_gib"] / result["specforge"]["peak_gib"], 3)
        common.write_result(name, result)
        line = {k: result.get(k) for k in ("seq", "ours", "ours_eager", "specforge", "speedup") if k in result}
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
