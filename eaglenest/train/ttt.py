"""Training-time test (TTT): the EAGLE-3 loss over k unrolled draft steps.

Alignment (decided once, tested in tests/test_ttt.py against a slow reference):
  sequence x_0..x_{T-1}, aux features f_t, teacher distribution P_q from the target's final
  state at position q (it predicts x_{q+1}), loss mask m_q (1 on assistant tokens).
  Step j at index t: input token x_{t+1+j} (ground truth), hidden = fuse(f_t) for j = 0 else
  draft.feedback(the draft's own step-(j-1) output at index t) (the post-norm state with EAGLE 3.1's
  norm_output, exactly what the decoder and the engines feed back), rope position t+j; it predicts x_{t+2+j}, so
  teacher = P_{t+1+j} and the loss mask is the *predicted* token's m_{t+2+j}
  (we align the mask with the label instead of leaving it unshifted as SpecForge does: it trains
  exactly the predictions whose answer is an assistant token, none of the prompt's).
  Positions whose teacher argmax is outside the draft vocabulary get no loss (nothing to learn),
  but still count as misses in the accuracy.
  Attention at step j: causal over step-0 keys, plus key t of each earlier step (diagonal).
  Per-step loss = sum(weight * softCE) / denominators[j]; total = sum_j 0.8^j * loss_j.

The teacher is computed once per batch over the draft vocabulary (never the full-vocabulary
probabilities per step; the full-vocab argmax is chunked); each step reads it through row indices
(no shifted [T, V] copies); draft logits are produced and consumed chunk by chunk under activation
checkpointing, so no [T, V] logits tensor is kept for backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils.checkpoint import checkpoint

from eaglenest.draft.kernels import causal_kernel
from eaglenest.draft.model import Eagle3Draft
from eaglenest.models.target import final_norm, soft_cap


@dataclass
class Teacher:
    """The target's output head restricted to the draft vocabulary (frozen)."""

    norm_weight: torch.Tensor | None  # applied iff the stored final state is pre-norm
    norm_eps: float
    lm_head: torch.Tensor  # [V, H] full target head (for the argmax)
    draft_rows: torch.Tensor  # [Vd] target ids of the draft vocabulary
    t2d: torch.Tensor  # [V] bool
    matmul_dtype: torch.dtype = torch.float32  # bf16 on CUDA: fp32 matmuls would cost ~2x the draft's step
    logit_softcap: float | None = None  # the target's tanh logit cap (Gemma 2; models/families.py), None for most
    _w: dict = field(default_factory=dict, repr=False)  # cached (full, draft-rows) heads per dtype

    def to(self, device) -> "Teacher":
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return Teacher(mv(self.norm_weight), self.norm_eps, mv(self.lm_head), mv(self.draft_rows), mv(self.t2d), self.matmul_dtype, self.logit_softcap)

    def heads(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = self._w.get(self.matmul_dtype)
        if w is None:
            W = self.lm_head.to(self.matmul_dtype)
            w = self._w[self.matmul_dtype] = (W, W[self.draft_rows])  # the draft rows once, not per batch
        return w

    @torch.no_grad()
    def targets(self, last_hidden: torch.Tensor, chunk: int | None = None, argmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """last_hidden [N, H] -> (teacher probabilities over the draft vocab [N, Vd] fp32, target argmax [N]).
        Full-vocabulary logits exist one chunk at a time ([chunk, V], transient).  `argmax` (known
        from an earlier epoch) skips the full-vocabulary head: on a small target it is most of the
        teacher's cost (SmolLM2: V = 6x the 8K draft vocabulary)."""
        chunk = chunk or (8192 if last_hidden.is_cuda else 2048)
        W, Wd = self.heads()
        N = last_hidden.shape[0]
        probs = torch.empty(N, Wd.shape[0], dtype=torch.float32, device=last_hidden.device)
        arg = torch.empty(N, dtype=torch.long, device=last_hidden.device) if argmax is None else argmax.to(last_hidden.device)
        for s in range(0, N, chunk):
            h = last_hidden[s : s + chunk].float()
            if self.norm_weight is not None:  # a pre-norm state (vLLM's): the target's own final norm first
                h = final_norm(h, self.norm_weight.float(), self.norm_eps)
            h = h.to(self.matmul_dtype)
            if argmax is None:  # max() not argmax(): ~3x faster on bf16 CPU logits (49K wide); soft-capping is monotone
                arg[s : s + chunk] = (h @ W.T).max(-1).indices
            z = soft_cap((h @ Wd.T).float(), self.logit_softcap)
            probs[s : s + chunk] = torch.softmax(z, dim=-1)  # once per batch, not per TTT step
        return probs, arg


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """x[:, t] <- x[:, t+n] along dim 1, padding the end with `fill`."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)


def step_weights(loss_mask: torch.Tensor, in_draft: torch.Tensor, ttt: int):
    """Per-step (loss weight, accuracy weight) [B, T] for steps 0..ttt-1 (see module docstring)."""
    out = []
    for j in range(ttt):
        m = shift_left(loss_mask, 2 + j).float()  # predicted token x_{t+2+j} is an assistant token
        w = m * shift_left(in_draft, 1 + j).float()  # and the teacher's argmax is representable
        out.append((w, m))
    return out


def denominators(loss_mask: torch.Tensor, ttt: int) -> torch.Tensor:
    """Tokens that count for each step's loss normalizer (known before any forward)."""
    return torch.stack([shift_left(loss_mask, 2 + j).float().sum() for j in range(ttt)])


class SoftCrossEntropy(torch.autograd.Function):
    """sum_i w_i * CE(p_i, softmax(z_i)) with its gradient written out: CE = lse(z) - p.z (the
    teacher rows sum to 1), d/dz = w (softmax(z) - p).  Autograd's log_softmax -> mul -> sum keeps
    and re-reads four [N, V] tensors per TTT step; this reads the logits ~4 times in all, which on
    a CPU is most of a small draft's step outside the matmuls.  Also returns the draft's argmax
    (max() on fp32 is ~4x faster than argmax() on bf16 on a CPU)."""

    @staticmethod
    def forward(ctx, logits, teacher, rows, w):
        z = logits.to(torch.promote_types(logits.dtype, torch.float32))
        lse = torch.logsumexp(z, dim=-1)
        ce = lse - torch.linalg.vecdot(z, teacher.index_select(0, rows).to(z.dtype))
        ctx.save_for_backward(z, teacher, rows, w, lse)  # the teacher by reference: no per-step copy
        ctx.in_dtype = logits.dtype
        arg = z.max(dim=-1).indices
        ctx.mark_non_differentiable(arg)
        return (ce * w).sum(), arg

    @staticmethod
    def backward(ctx, g, _g_arg):
        z, teacher, rows, w, lse = ctx.saved_tensors
        z = z.clone() if z.dtype == ctx.in_dtype else z  # z aliases the logits: do not overwrite them
        grad = z.sub_(lse[:, None]).exp_().sub_(teacher.index_select(0, rows).to(z.dtype)).mul_((w.to(z.dtype) * g)[:, None])
        return grad.to(ctx.in_dtype), None, None, None


def _chunk_loss(draft: Eagle3Draft, h: torch.Tensor, rows: torch.Tensor, teacher: torch.Tensor, trows: torch.Tensor, w: torch.Tensor):
    """Soft cross-entropy of the kept rows of one contiguous chunk of hidden states.  The teacher
    rows are gathered inside, so neither a checkpoint nor autograd keeps a [chunk, V] copy of them."""
    logits = draft.logits(h.index_select(0, rows))
    return SoftCrossEntropy.apply(logits, teacher, trows, w)


def ttt_forward(
    draft: Eagle3Draft,
    input_ids: torch.Tensor,  # [B, T] int64
    aux: torch.Tensor,  # [B, T, 3H]
    teacher_probs: torch.Tensor,  # [B, T, Vd] fp32 (from Teacher.targets, reshaped)
    teacher_argmax: torch.Tensor,  # [B, T] target ids
    loss_mask: torch.Tensor,  # [B, T]
    ttt: int,
    denom: torch.Tensor,  # [ttt] normalizers (global over the optimizer step)
    step_decay: float = 0.8,
    chunk: int = 1024,
    checkpoint_logits: bool = True,
    attn_impl="eager",
    recompute: bool = False,
) -> tuple[torch.Tensor, dict]:
    """Returns (weighted total loss, stats with per-step loss sums, correct and counted tokens).

    attn_impl: "eager" (reference, materializes [T, T] scores), "chunked" or "flex", or a kernel
    object from eaglenest.draft.kernels.causal_kernel (the trainer keeps one: flex's compiled
    function and block masks live on it); recompute: run each draft step under activation
    checkpointing (keeps ~its inputs, K/V and output per step instead of every intermediate)."""
    B, T = input_ids.shape
    dev = input_ids.device
    kernel = causal_kernel(attn_impl) if isinstance(attn_impl, str) else attn_impl
    pos = torch.arange(T, device=dev).expand(B, T)
    in_draft = draft.t2d[teacher_argmax]
    weights = step_weights(loss_mask, in_draft, ttt)
    hidden = draft.fuse(aux)
    past_diag: list[tuple[torch.Tensor, torch.Tensor]] = []
    ctx_kv = None
    grad = torch.is_grad_enabled()
    total = hidden.new_zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32))
    teacher = teacher_probs.reshape(B * T, -1)  # a view: never shifted or copied per step
    targ = teacher_argmax.reshape(-1)
    per_step = []  # (loss_sum, correct, count, loss_count) as tensors: one host sync at the end
    for j in range(ttt):
        tok = shift_left(input_ids, 1 + j)
        # step 0: its own keys causally; step j: step 0's keys causally + key t of steps 1..j
        kw = dict(ctx_kv=ctx_kv, diag_kv=list(past_diag), kernel=kernel)
        if recompute and grad:
            h, kv = checkpoint(draft.ttt_step, tok, hidden, pos + j, use_reentrant=False, **kw)
        else:
            h, kv = draft.ttt_step(tok, hidden, pos + j, **kw)
        if j == 0:
            ctx_kv = kv
        else:
            past_diag.append(kv)
        w, m = weights[j]
        wf, mf = w.reshape(-1), m.reshape(-1)
        loss_sum = h.new_zeros((), dtype=total.dtype)
        correct = h.new_zeros((), dtype=torch.float32)
        keep = (mf > 0).nonzero(as_tuple=True)[0]  # only positions that count: saves lm_head work
        bounds = torch.searchsorted(keep.cpu(), torch.arange(0, B * T + chunk, chunk)).tolist()
        for c, hc in enumerate(h.reshape(B * T, -1).split(chunk)):  # views; one cat in backward
            a, b = bounds[c], bounds[c + 1]
            if a == b:
                continue
            rows = keep[a:b]
            trows = rows + 1 + j  # teacher P_{t+1+j} (in range: the mask is 0 where t+2+j >= T)
            args = (hc, rows - c * chunk, teacher, trows, wf[rows])
            if checkpoint_logits and grad:
                ls, am = checkpoint(_chunk_loss, draft, *args, use_reentrant=False)
            else:
                ls, am = _chunk_loss(draft, *args)
            loss_sum = loss_sum + ls
            correct = correct + ((draft.to_target_ids(am) == targ[trows]).float() * mf[rows]).sum()
        total = total + (step_decay**j) * loss_sum / denom[j].clamp_min(1.0)
        per_step.append(torch.stack([loss_sum.detach(), correct, m.sum(), w.sum()]).double())
        hidden = draft.feedback(h)
    vals = torch.stack(per_step).tolist()
    stats = {k: [v[i] for v in vals] for i, k in enumerate(("loss_sum", "correct", "count", "loss_count"))}
    return total, stats
