"""The draft loss as it was before the fused head + loss (eaglenest/train/losses.py at 2edb2ad,
`_ChunkLoss` and `chunk_loss`, verbatim but for this header and the imports): the oracle that
tests/test_head_loss.py holds the fused version to, in fp64."""

from __future__ import annotations

import torch

from eaglenest.models.target import soft_cap
from eaglenest.train.losses import ALPHA_FLOOR, LossSpec, TeacherRows


class _ChunkLoss(torch.autograd.Function):
    """sum_i w_i * sum_k c_k * loss_k(p_i, softmax(z_i)), its gradient written out (see the module
    docstring).  Autograd's log_softmax -> mul -> sum would keep and re-read four [c, Vd] tensors
    per TTT step; this keeps the fp32 logits only and recomputes the rest in backward.  The teacher
    is saved by reference (no per-step copy of its rows).  Also returns the draft's argmax and,
    when asked, alpha and the target's probability of the draft's argmax per row (both detached)."""

    @staticmethod
    def forward(ctx, logits, t_logits, log_mass, rows, w, spec: LossSpec, softcap, want_alpha: bool, probs_cache):
        z = logits.to(torch.promote_types(logits.dtype, torch.float32))
        teacher = TeacherRows(t_logits, None, log_mass, softcap, probs_cache)
        lse = torch.logsumexp(z, dim=-1)
        ph = teacher.probs(rows).to(z.dtype)
        need_alpha = spec.needs_alpha or want_alpha
        per = {}
        if spec.weight("ce") or spec.weight("kl") or spec.weight("lk_hybrid"):
            per["ce"] = lse - torch.linalg.vecdot(z, ph)
        if spec.weight("kl") or spec.weight("lk_hybrid"):
            t = soft_cap(t_logits.index_select(0, rows).to(z.dtype), softcap)
            ent = torch.logsumexp(t, dim=-1) - torch.linalg.vecdot(t, ph)  # H(p^)
            per["kl"] = per["ce"] - ent
        alpha = pt_arg = None
        arg = z.max(dim=-1).indices
        if need_alpha:
            S = teacher.mass(rows).to(z.dtype)
            q = z.sub(lse[:, None]).exp_()
            alpha = torch.minimum(ph * S[:, None], q).sum(-1)
            pt_arg = ph.gather(1, arg[:, None])[:, 0] * S  # accepted with this probability when the draft proposes its argmax
            del q
        loss = None
        for name, c in spec.terms:
            if name == "ce":
                v = per["ce"]
            elif name == "kl":
                v = per["kl"]
            elif name == "tv":
                v = 1.0 - alpha
            elif name == "nla":
                v = -alpha.clamp_min(ALPHA_FLOOR).log()
            else:  # lk_hybrid
                lam = torch.exp(-spec.eta * alpha)
                v = lam * per["kl"] + (1.0 - lam) * (1.0 - alpha)
            v = v if c == 1.0 else c * v
            loss = v if loss is None else loss + v
        none = z.new_empty(0)
        ctx.save_for_backward(z, t_logits, none if log_mass is None else log_mass, rows, w, lse, none if probs_cache is None else probs_cache)
        ctx.spec, ctx.softcap, ctx.in_dtype = spec, softcap, logits.dtype
        if alpha is None:
            alpha, pt_arg = z.new_empty(0), z.new_empty(0)
        ctx.mark_non_differentiable(arg, alpha, pt_arg)
        return (loss * w.to(loss.dtype)).sum(), arg, alpha, pt_arg

    @staticmethod
    def backward(ctx, g, _g_arg, _g_alpha, _g_pt):
        z, t_logits, log_mass, rows, w, lse, probs_cache = ctx.saved_tensors
        spec = ctx.spec
        teacher = TeacherRows(t_logits, None, log_mass if log_mass.numel() else None, ctx.softcap,
                              probs_cache if probs_cache.numel() else None)
        ph = teacher.probs(rows).to(z.dtype)
        z = z.clone() if z.dtype == ctx.in_dtype else z  # z aliases the logits: do not overwrite them
        q = z.sub_(lse[:, None]).exp_()
        wg = w.to(z.dtype) * g
        if spec.terms == (("ce", 1.0),):  # the former SoftCrossEntropy's exact operations
            return q.sub_(ph).mul_(wg[:, None]).to(ctx.in_dtype), *[None] * 8
        # grad = c_kl (q - p^) + c_alpha dalpha/dz, dalpha/dz = q (m - A), m = [q < p], A = <m, q>, i.e.
        # q * (c_kl - c_alpha A + c_alpha m) - c_kl p^, with w g folded into the per-row coefficients
        c_kl = (spec.weight("ce") + spec.weight("kl")) * wg  # per row
        if not spec.needs_alpha:
            return q.sub_(ph).mul_(c_kl[:, None]).to(ctx.in_dtype), *[None] * 8
        p = ph * teacher.mass(rows).to(z.dtype)[:, None]
        alpha = torch.minimum(p, q).sum(-1)
        m = q < p
        del p
        mf = m.to(q.dtype)
        A = torch.linalg.vecdot(q, mf)
        c_alpha = torch.zeros_like(alpha)
        if spec.weight("tv"):
            c_alpha -= spec.weight("tv")
        if spec.weight("nla"):
            c_alpha -= spec.weight("nla") / alpha.clamp_min(ALPHA_FLOOR)
        if spec.weight("lk_hybrid"):
            lam = torch.exp(-spec.eta * alpha)  # sg(alpha): lambda is a constant of the gradient
            c_alpha -= spec.weight("lk_hybrid") * (1.0 - lam)
            c_kl = c_kl + spec.weight("lk_hybrid") * lam * wg
        c_alpha *= wg
        a = c_kl - c_alpha * A
        grad = mf.mul_(c_alpha[:, None]).add_(a[:, None]).mul_(q)
        if spec.weight("ce") or spec.weight("kl") or spec.weight("lk_hybrid"):
            grad.addcmul_(ph, c_kl[:, None], value=-1.0)
        return grad.to(ctx.in_dtype), *[None] * 8


def chunk_loss(logits: torch.Tensor, teacher: TeacherRows, rows: torch.Tensor, w: torch.Tensor, spec: LossSpec,
               want_alpha: bool = False):
    """One chunk: draft logits [c, Vd] against teacher rows `rows` ([c] indices into `teacher`),
    position weights w [c] -> (sum_i w_i loss_i (differentiable), draft argmax [c] (draft ids),
    alpha [c] or empty, p(draft argmax) [c] or empty).  alpha (= sum_v min(p_v, q_v), the acceptance
    probability of speculative sampling at temperature 1) and p(argmax) (the acceptance of a
    greedily drafted token under temperature-1 verification, SGLang's and vLLM's default) are
    computed when the loss needs them or `want_alpha` (the held-out evaluation)."""
    lm = teacher.log_mass
    if (spec.needs_alpha or want_alpha) and lm is None:
        teacher.mass(rows)  # the clear error
    return _ChunkLoss.apply(logits, teacher.logits, lm, rows, w, spec, teacher.softcap, want_alpha, teacher.probs_cache)
