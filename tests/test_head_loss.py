"""The fused draft head + loss (losses.head_loss): the same values and gradients, in h and in the head's
weight, as the head followed by the previous loss (tests/previous_loss.py) in fp64 for every loss;
hard labels as cross-entropy; no [rows, vocab] tensor kept for backward and no head matmul in it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from previous_loss import chunk_loss as previous_chunk_loss
from torch.utils._python_dispatch import TorchDispatchMode

from eaglenest.train.losses import HardTarget, LossSpec, SoftTarget, TeacherRows, head_loss

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MIXES = ["ce", "kl", "tv", "nla", "lk_hybrid", "ce:0.1,tv:0.9", "kl:0.5,nla:2,lk_hybrid:0.25"]


def problem(seed=0, R=37, N=50, V=90, Vd=60, H=16, softcap=None, dtype=torch.float64):
    """Rows h [R, H], a head W [Vd, H], a teacher of N positions over a V-token vocabulary (Vd of them
    the draft's), R teacher rows (repeats included, as TTT reads them) and per-row coefficients."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(N, V, generator=g, dtype=dtype) * 2.5
    vocab = torch.randperm(V, generator=g)[:Vd].sort().values
    capped = full if not softcap else (full / softcap).tanh() * softcap
    teacher = TeacherRows(full[:, vocab], full.argmax(-1), torch.logsumexp(capped[:, vocab], -1) - torch.logsumexp(capped, -1), softcap)
    h = torch.randn(R, H, generator=g, dtype=dtype).requires_grad_()
    W = (torch.randn(Vd, H, generator=g, dtype=dtype) * 0.7).requires_grad_()
    rows = torch.randint(0, N, (R,), generator=g)
    coef = torch.rand(R, generator=g, dtype=dtype) + 0.25
    coef[3] = 0.0  # a row whose teacher argmax is outside the draft vocabulary
    return h, W, teacher, rows, coef


@pytest.mark.parametrize("softcap", [None, 4.0])
@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("chunk", [8, 64])
def test_fused_equals_head_then_previous_loss_fp64(mix, softcap, chunk):
    spec = LossSpec.parse(mix, eta=2.5)
    h, W, teacher, rows, coef = problem(softcap=softcap)
    val, per_row, arg, alpha, p_arg = head_loss(h, W, SoftTarget(teacher, rows, spec), coef, chunk, want_alpha=True)
    gh, gw = torch.autograd.grad(val * 1.7, (h, W))  # an upstream gradient other than 1
    ref, ref_arg, ref_alpha, ref_p = previous_chunk_loss(h @ W.T, teacher, rows, coef, spec, want_alpha=True)
    rh, rw = torch.autograd.grad(ref * 1.7, (h, W))
    torch.testing.assert_close(val, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gh, rh, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gw, rw, rtol=1e-10, atol=1e-12)
    assert torch.equal(arg, ref_arg)
    torch.testing.assert_close(alpha, ref_alpha, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(p_arg, ref_p, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close((per_row * coef).sum(), val, rtol=1e-12, atol=1e-12)  # the per-row values the stats sum
    assert gh.abs().max() > 1e-3 and gw.abs().max() > 1e-3  # real gradients


def test_hard_labels_are_cross_entropy():
    h, W, _, _, coef = problem(seed=4)
    labels = torch.randint(0, W.shape[0], (h.shape[0],), generator=torch.Generator().manual_seed(5))
    val, per_row, arg, alpha, _ = head_loss(h, W, HardTarget(labels), coef, 10)
    gh, gw = torch.autograd.grad(val, (h, W))
    logits = h @ W.T
    ce = F.cross_entropy(logits, labels, reduction="none")
    ref = (ce * coef).sum()
    rh, rw = torch.autograd.grad(ref, (h, W))
    torch.testing.assert_close(val, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(per_row, ce.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gh, rh, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gw, rw, rtol=1e-10, atol=1e-12)
    assert torch.equal(arg, logits.argmax(-1)) and alpha.numel() == 0


def test_frozen_head_and_no_grad():
    """A frozen head gets no gradient (none computed); without autograd only the values."""
    h, W, teacher, rows, coef = problem(seed=2)
    W.requires_grad_(False)
    val = head_loss(h, W, SoftTarget(teacher, rows), coef, 16)[0]
    (gh,) = torch.autograd.grad(val, (h,))
    assert gh.abs().max() > 1e-3
    with torch.no_grad():
        v2, per_row, *_ = head_loss(h, W, SoftTarget(teacher, rows), coef, 16)
    torch.testing.assert_close(v2, val.detach(), rtol=1e-12, atol=0)
    assert not v2.requires_grad


class _CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default, torch.ops.aten.mm.out):
            self.n += 1
        return func(*args, **(kwargs or {}))


def test_no_logits_kept_for_backward_and_none_recomputed():
    """What backward keeps is the rows' and the head's gradients ([R, H] and [Vd, H]), nothing of
    [rows, Vd]; backward runs no matmul (the head is not recomputed)."""
    h, W, teacher, rows, coef = problem(seed=6, R=200, Vd=60, H=16)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        val = head_loss(h, W, SoftTarget(teacher, rows, LossSpec.parse("lk_hybrid")), coef, 32)[0]
    assert sorted(saved) == sorted([(200, 16), (60, 16)]), saved
    with _CountMatmuls() as m:
        val.backward()
    assert m.n == 0 and h.grad is not None and W.grad is not None
    with pytest.raises(RuntimeError, match="backward twice"):
        h2, W2, t2, r2, c2 = problem(seed=7)
        v = head_loss(h2, W2, SoftTarget(t2, r2), c2, 8)[0]
        v.backward(retain_graph=True)
        v.backward()


def test_bf16_head_within_bf16_rounding_of_fp64():
    """Under bf16 (the logits' matmul in bf16, the loss in fp32) the loss and gradients stay within
    bf16's rounding of the fp64 values (2^-8 relative per rounding; a few roundings on each path)."""
    h, W, teacher, rows, coef = problem(seed=8, R=64, V=200, Vd=120, H=32)
    v64 = head_loss(h, W, SoftTarget(teacher, rows), coef, 16)[0]
    g64 = torch.autograd.grad(v64, (h, W))
    hb, Wb = (x.detach().to(torch.bfloat16).requires_grad_() for x in (h, W))
    tb = TeacherRows(teacher.logits.to(torch.bfloat16), teacher.argmax)
    vb = head_loss(hb, Wb, SoftTarget(tb, rows), coef.float(), 16)[0]
    gb = torch.autograd.grad(vb, (hb, Wb))
    assert vb.dtype == torch.float32 and gb[0].dtype == gb[1].dtype == torch.bfloat16
    torch.testing.assert_close(vb.double(), v64.detach(), rtol=2e-2, atol=0)
    for a, b in zip(gb, g64):
        assert (a.double() - b).norm() <= 0.03 * b.norm()


def test_compiled_cpu_rows_equal_the_torch_path(monkeypatch):
    """A CPU chunk of bf16 logits under `ce` with p^ cached (the demo's training step) and under hard
    labels (DFlash) runs the compiled loss (losses._ce_rows, _hard_rows): its loss, the draft's argmax
    (ties to the first maximum) and the gradients equal the eager torch path's up to fp32 summation
    order and one bf16 rounding."""
    from eaglenest.train import losses

    h, W, teacher, rows, coef = problem(seed=9, R=96, V=300, Vd=160, H=32)
    hb, Wb = (x.detach().to(torch.bfloat16) for x in (h, W))
    zt = teacher.logits.round().to(torch.bfloat16)  # integer logits: ties inside a row
    tb = TeacherRows(zt, teacher.argmax, probs_cache=torch.softmax(zt.float(), -1))
    z = (torch.randn(96, 160, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 2).round().to(torch.bfloat16)
    labels = torch.randint(0, 160, (96,), generator=torch.Generator().manual_seed(2))
    out = {}
    for mode in ("torch", "auto"):
        monkeypatch.setenv("EAGLENEST_LOSS_KERNEL", mode)
        hm, Wm = hb.clone().requires_grad_(), Wb.clone().requires_grad_()
        v, per, arg, _, _ = head_loss(hm, Wm, SoftTarget(tb, rows), coef.float(), 32)
        out[mode] = (v, per, arg, *torch.autograd.grad(v, (hm, Wm)))
        out[mode] += losses.soft_rows(z.clone(), tb, rows, LossSpec(), torch.bfloat16, False)[:3]  # the rows alone: ties again
        out[mode] += losses.hard_rows(z.clone(), labels, torch.bfloat16)
    assert all(callable(losses._COMPILED.get(n)) for n in ("_ce_rows", "_hard_rows")), losses._COMPILED  # compiled, not after a failed build
    t, a = out["torch"], out["auto"]
    torch.testing.assert_close(a[0], t[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a[1], t[1], rtol=1e-5, atol=1e-5)
    assert torch.equal(a[2], t[2]) and torch.equal(a[7], t[7])
    for x, y in zip(a[3:5], t[3:5]):
        assert x.dtype == torch.bfloat16 and (x.double() - y.double()).norm() <= 1e-2 * y.double().norm()
    torch.testing.assert_close(a[5], t[5], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a[6].float(), t[6].float(), rtol=2**-7, atol=1e-6)
    torch.testing.assert_close(a[8], t[8], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a[9].float(), t[9].float(), rtol=2**-7, atol=1e-6)
    assert torch.equal(a[10], t[10])
