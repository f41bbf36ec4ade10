"""The drafts' RMSNorm (draft/layers.py) with its backward written out: the same outputs and gradients
as autograd through the Llama formula -- to fp64 rounding in fp64, one bf16 rounding in bf16 -- for
every shape the kinds use (rows, [B, T, H], DFlash's per-head [B, heads, T, d]), a bf16 input
with an fp32 weight (the CPU's fp32-parameter runs), and a frozen weight."""

from __future__ import annotations

import pytest
import torch

from eaglenest.draft.model import RMSNorm, _RMSNormFn, _rms_normalize


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The formula, through autograd (what RMSNorm.forward was before its backward was written out)."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def grads(fn, x0, w0, g):
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    y = fn(x, w)
    y.backward(g)
    return y.detach(), x.grad, w.grad


def module_with(w: torch.Tensor, eps: float) -> RMSNorm:
    m = RMSNorm(w.shape[0], eps)
    with torch.no_grad():
        m.weight.data = w.detach().clone()
    return m


@pytest.mark.parametrize("shape", [(37, 24), (2, 19, 24), (2, 3, 11, 24)])
def test_gradients_equal_autograd_through_the_formula_in_fp64(shape):
    torch.manual_seed(0)
    eps = 1e-5
    x0 = torch.randn(*shape, dtype=torch.float64) * 3
    w0 = 1 + 0.3 * torch.randn(shape[-1], dtype=torch.float64)
    g = torch.randn(*shape, dtype=torch.float64)
    m = module_with(w0, eps)
    x = x0.clone().requires_grad_()
    y = m(x)
    y.backward(g)
    ry, rx, rw = grads(lambda a, b: reference(a, b, eps), x0, w0, g)
    assert torch.equal(y.detach(), ry)  # the forward is the same operations
    torch.testing.assert_close(x.grad, rx, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m.weight.grad, rw, rtol=1e-12, atol=1e-12)
    # and against finite differences (not only against another implementation)
    assert torch.autograd.gradcheck(lambda a, b: _RMSNormFn.apply(a, b, eps), (x0[..., :5, :].clone().requires_grad_(), w0.clone().requires_grad_()))


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
def test_bf16_input_gives_the_formulas_dtypes_and_values_to_one_rounding(wdtype):
    torch.manual_seed(1)
    eps = 1e-6
    x0 = (torch.randn(64, 48) * 2).to(torch.bfloat16)
    w0 = (1 + 0.2 * torch.randn(48)).to(wdtype)
    g = torch.randn(64, 48).to(torch.promote_types(torch.bfloat16, wdtype))
    m = module_with(w0, eps)
    x = x0.clone().requires_grad_()
    y = m(x)
    y.backward(g)
    ry, rx, rw = grads(lambda a, b: reference(a, b, eps), x0, w0, g)
    assert y.dtype == ry.dtype and x.grad.dtype == rx.dtype == torch.bfloat16 and m.weight.grad.dtype == rw.dtype == wdtype
    assert torch.equal(y.detach(), ry)
    # the written-out backward rounds once where autograd rounds per op: equal to a bf16 rounding or two
    torch.testing.assert_close(x.grad.float(), rx.float(), rtol=2 * 2**-8, atol=2 * 2**-8 * rx.float().abs().max().item())
    torch.testing.assert_close(m.weight.grad.float(), rw.float(), rtol=2 * 2**-8, atol=1e-3 * rw.float().abs().max().item())


def test_a_frozen_weight_gets_no_gradient_and_inference_skips_the_function():
    eps = 1e-5
    x0 = torch.randn(8, 16, dtype=torch.float64)
    m = module_with(torch.rand(16, dtype=torch.float64) + 0.5, eps)
    m.weight.requires_grad_(False)
    x = x0.clone().requires_grad_()
    m(x).sum().backward()
    assert m.weight.grad is None
    ref = x0.clone().requires_grad_()
    reference(ref, m.weight, eps).sum().backward()
    torch.testing.assert_close(x.grad, ref.grad, rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        out = m(x0)
    assert out.grad_fn is None and torch.equal(out, m.weight * _rms_normalize(x0, eps)[0])
