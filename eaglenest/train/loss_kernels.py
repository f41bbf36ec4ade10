"""The fused loss's per-chunk work on CUDA as Triton kernels: one program per row reads the row's draft
logits (bf16, straight from the head's matmul) and its teacher row twice -- once for the online
softmax statistics, the argmax and the dot products, once to write the gradient over the logits in
place -- where the torch path (losses.soft_rows / hard_rows) makes ~10 passes over fp32 copies.

Covered: `ce`, `kl` and their mixes against the teacher's p^ (from its probability cache or from its
logits, soft-capped or not), and hard labels (DFlash).  The acceptance losses (tv, nla, lk_hybrid)
and the held-out evaluation's alpha statistics stay on the torch path.  Our own kernels rather than
Liger-Kernel's: its fused linear losses take a teacher *hidden state and head* (JSD) or hard labels,
not a teacher row of probabilities, and none of them knows p^'s renormalization over the draft
vocabulary or our per-row coefficients.  The head's matmuls stay cuBLAS's (losses._HeadLoss).

Imported only where they can run (losses.use_kernels: CUDA, or `TRITON_INTERPRET=1`, which runs the
same kernels on CPU tensors: tests/test_loss_kernels.py); on CUDA they are checked in bf16 against
the torch path by bench/gpu_run.sh.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _online_max_sum(z, ok, off, mz, sz, best, bidx):
    """One block of a row's logits into its running max, sum of exp (rescaled as the max grows) and argmax."""
    bm = tl.max(z, axis=0)
    ba = tl.argmax(z, axis=0)
    take = bm > best  # strictly: the first maximum wins, as torch's max
    bidx = tl.where(take, off + ba, bidx)
    best = tl.where(take, bm, best)
    m_new = tl.maximum(mz, bm)
    sz = sz * tl.exp(mz - m_new) + tl.sum(tl.where(ok, tl.exp(z - m_new), 0.0), axis=0)
    return m_new, sz, best, bidx


@triton.jit
def _soft_kernel(z_ptr, z_stride, t_ptr, t_stride, rows_ptr, loss_ptr, arg_ptr, w_ce, w_kl, cap, V: tl.constexpr,
                 PROBS: tl.constexpr, SOFTCAP: tl.constexpr, GRAD: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + i * z_stride
    t_row = t_ptr + tl.load(rows_ptr + i).to(tl.int64) * t_stride
    # pass 1: online max/sum of z (and of t when it comes as logits), the argmax, and the sums
    # <z, e^(t - mt)>, <t, e^(t - mt)> (rescaled as mt grows) that give <z, p^> and H(p^)
    mz = -float("inf")
    sz = 0.0
    best = -float("inf")
    bidx = 0
    mt = -float("inf")
    st = 0.0
    zt = 0.0
    tt = 0.0
    for off in range(0, V, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        ok = cols < V
        z = tl.load(z_row + cols, mask=ok, other=-float("inf")).to(tl.float32)
        mz, sz, best, bidx = _online_max_sum(z, ok, off, mz, sz, best, bidx)
        zs = tl.where(ok, z, 0.0)
        if PROBS:
            ph = tl.load(t_row + cols, mask=ok, other=0.0).to(tl.float32)
            zt += tl.sum(zs * ph, axis=0)
            tt += tl.sum(tl.where(ph > 0, ph * tl.log(ph), 0.0), axis=0)  # -H(p^)
        else:
            t = tl.load(t_row + cols, mask=ok, other=-float("inf")).to(tl.float32)
            if SOFTCAP:
                t = cap * (2.0 / (1.0 + tl.exp(-2.0 * t / cap)) - 1.0)  # cap * tanh(t / cap)
                t = tl.where(ok, t, -float("inf"))
            mt_new = tl.maximum(mt, tl.max(t, axis=0))
            r = tl.exp(mt - mt_new)
            e = tl.where(ok, tl.exp(t - mt_new), 0.0)
            st = st * r + tl.sum(e, axis=0)
            zt = zt * r + tl.sum(zs * e, axis=0)
            tt = tt * r + tl.sum(tl.where(ok, t, 0.0) * e, axis=0)
            mt = mt_new
    lse_z = mz + tl.log(sz)
    if PROBS:
        ce = lse_z - zt
        neg_h = tt
    else:
        lse_t = mt + tl.log(st)
        ce = lse_z - zt / st
        neg_h = tt / st - lse_t
    tl.store(loss_ptr + i, w_ce * ce + w_kl * (ce + neg_h))
    tl.store(arg_ptr + i, bidx)
    if GRAD:  # pass 2: (w_ce + w_kl) (q - p^) over the logits, in place
        c = w_ce + w_kl
        for off in range(0, V, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            ok = cols < V
            z = tl.load(z_row + cols, mask=ok, other=0.0).to(tl.float32)
            if PROBS:
                ph = tl.load(t_row + cols, mask=ok, other=0.0).to(tl.float32)
            else:
                t = tl.load(t_row + cols, mask=ok, other=0.0).to(tl.float32)
                if SOFTCAP:
                    t = cap * (2.0 / (1.0 + tl.exp(-2.0 * t / cap)) - 1.0)
                ph = tl.exp(t - lse_t)
            g = c * (tl.exp(z - lse_z) - ph)
            tl.store(z_row + cols, g.to(z_ptr.dtype.element_ty), mask=ok)

@triton.jit
def _hard_kernel(z_ptr, z_stride, lab_ptr, loss_ptr, arg_ptr, V: tl.constexpr, GRAD: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + i * z_stride
    lab = tl.load(lab_ptr + i)
    mz = -float("inf")
    sz = 0.0
    best = -float("inf")
    bidx = 0
    for off in range(0, V, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        ok = cols < V
        z = tl.load(z_row + cols, mask=ok, other=-float("inf")).to(tl.float32)
        mz, sz, best, bidx = _online_max_sum(z, ok, off, mz, sz, best, bidx)
    lse_z = mz + tl.log(sz)
    zl = tl.load(z_row + lab).to(tl.float32)
    tl.store(loss_ptr + i, lse_z - zl)
    tl.store(arg_ptr + i, bidx)
    if GRAD:
        for off in range(0, V, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            ok = cols < V
            z = tl.load(z_row + cols, mask=ok, other=0.0).to(tl.float32)
            g = tl.exp(z - lse_z) - tl.where(cols == lab, 1.0, 0.0)
            tl.store(z_row + cols, g.to(z_ptr.dtype.element_ty), mask=ok)



def soft_rows(z: torch.Tensor, teacher, rows: torch.Tensor, spec, grad: bool):
    """losses.soft_rows for `ce`/`kl` mixes on the kernels: (loss [c] fp32, dz (z itself, overwritten) or
    None, argmax [c]).  None when the spec is not one the kernel computes."""
    if spec.needs_alpha or any(n not in ("ce", "kl") for n, _ in spec.terms):
        return None
    c, V = z.shape
    loss = torch.empty(c, dtype=torch.float32, device=z.device)
    arg = torch.empty(c, dtype=torch.long, device=z.device)
    probs = teacher.probs_cache is not None
    src = teacher.probs_cache if probs else teacher.logits
    cap = float(teacher.softcap or 0.0)
    if c:
        _soft_kernel[(c,)](z, z.stride(0), src, src.stride(0), rows, loss, arg, float(spec.weight("ce")), float(spec.weight("kl")),
                           cap, V=V, PROBS=probs, SOFTCAP=bool(cap) and not probs, GRAD=grad, BLOCK=BLOCK)
    return loss, (z if grad else None), arg


def hard_rows(z: torch.Tensor, labels: torch.Tensor, grad: bool):
    """losses.hard_rows on the kernel: (loss [c] fp32, dz (z itself, overwritten) or None, argmax [c])."""
    c, V = z.shape
    loss = torch.empty(c, dtype=torch.float32, device=z.device)
    arg = torch.empty(c, dtype=torch.long, device=z.device)
    if c:
        _hard_kernel[(c,)](z, z.stride(0), labels, loss, arg, V=V, GRAD=grad, BLOCK=BLOCK)
    return loss, (z if grad else None), arg
