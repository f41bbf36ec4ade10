"""The fused loss's Triton kernels (train/loss_kernels.py) compute what the torch path computes.

On the CPU they run under Triton's interpreter (TRITON_INTERPRET=1, set before Triton is imported, so
in a child process): fp32 logits, every covered loss (ce, kl, a mix; the teacher as a probability
cache or as logits, soft-capped or not) and hard labels, within fp32 rounding; the whole fused head +
loss through them equals the torch path.  On CUDA (bench/gpu_run.sh) the same in bf16, within a
stated tolerance.  Skipped where Triton is not installed (a CPU-only torch without it)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")

CHILD = textwrap.dedent('''
    import torch
    from eaglenest.train import loss_kernels as K
    from eaglenest.train.losses import LossSpec, SoftTarget, TeacherRows, hard_rows, head_loss, soft_rows

    g = torch.Generator().manual_seed(0)
    c, N, V = 13, 20, 2500                      # V > the kernels' block: several blocks per row
    t_logits = torch.randn(N, V, generator=g) * 3
    rows = torch.randint(0, N, (c,), generator=g)
    worst = 0.0
    for cap in (None, 5.0):
        for cached in (False, True):
            capped = t_logits if cap is None else (t_logits / cap).tanh() * cap
            teacher = TeacherRows(t_logits, torch.zeros(N, dtype=torch.long), None, cap,
                                  torch.softmax(capped, -1) if cached else None)
            for mix in ("ce", "kl", "ce:0.3,kl:0.7"):
                spec = LossSpec.parse(mix)
                z = torch.randn(c, V, generator=g) * 4
                z[2, 7] = z[2, 1900] = z[2].max() + 1  # a tie: the first maximum, as torch's max
                l_ref, g_ref, a_ref, _, _ = soft_rows(z.clone(), teacher, rows, spec, torch.float32, False)
                zk = z.clone()
                l, gk, a = K.soft_rows(zk, teacher, rows, spec, True)
                assert gk is zk                       # the gradient overwrites the logits
                assert torch.equal(a, a_ref), (mix, cap, cached)
                torch.testing.assert_close(l, l_ref, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(gk, g_ref, rtol=1e-4, atol=1e-7)
                worst = max(worst, float((gk - g_ref).abs().max()))
    assert K.soft_rows(z, teacher, rows, LossSpec.parse("tv"), True) is None  # left to the torch path
    labels = torch.randint(0, V, (c,), generator=g)
    z = torch.randn(c, V, generator=g) * 4
    l_ref, g_ref, a_ref = hard_rows(z.clone(), labels, torch.float32)
    l, gk, a = K.hard_rows(z.clone(), labels, True)
    assert torch.equal(a, a_ref)
    torch.testing.assert_close(l, l_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gk, g_ref, rtol=1e-4, atol=1e-7)
    # the fused head + loss through the kernels == through the torch path
    h = torch.randn(40, 24, generator=g, requires_grad=True)
    W = (torch.randn(V, 24, generator=g) * 0.3).requires_grad_()
    coef = torch.rand(40, generator=g)
    r40 = torch.randint(0, N, (40,), generator=g)
    out = {}
    for mode in ("auto", "torch"):
        import os
        os.environ["EAGLENEST_LOSS_KERNEL"] = mode
        v = head_loss(h, W, SoftTarget(teacher, r40, LossSpec.parse("kl")), coef, 16)[0]
        out[mode] = (v, *torch.autograd.grad(v, (h, W)))
    for x, y in zip(out["auto"], out["torch"]):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)
    print("OK", worst)
''')


def test_kernels_equal_the_torch_path_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "EAGLENEST_LOSS_KERNEL": "auto"}
    r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run by bench/gpu_run.sh)")
def test_kernels_in_bf16_on_cuda_within_tolerance():
    """bf16 logits on CUDA, kernels vs the torch path (both reading the same bf16 logits; the kernel
    writes its gradient in bf16): losses within 1e-3 relative, gradients within 2 bf16 ulps (2^-6
    relative) of the larger entries, argmax equal."""
    from eaglenest.train import loss_kernels as K
    from eaglenest.train.losses import LossSpec, TeacherRows, hard_rows, soft_rows

    g = torch.Generator(device="cuda").manual_seed(0)
    c, N, V = 512, 1024, 32000
    t_logits = (torch.randn(N, V, generator=g, device="cuda") * 3).to(torch.bfloat16)
    rows = torch.randint(0, N, (c,), generator=g, device="cuda")
    for cached in (False, True):
        teacher = TeacherRows(t_logits, None, None, None, torch.softmax(t_logits.float(), -1) if cached else None)
        for mix in ("ce", "kl"):
            spec = LossSpec.parse(mix)
            z = (torch.randn(c, V, generator=g, device="cuda") * 4).to(torch.bfloat16)
            l_ref, g_ref, a_ref, _, _ = soft_rows(z.clone(), teacher, rows, spec, torch.bfloat16, False)
            l, gk, a = K.soft_rows(z.clone(), teacher, rows, spec, True)
            assert torch.equal(a, a_ref)
            torch.testing.assert_close(l, l_ref, rtol=1e-3, atol=1e-3)
            assert ((gk.float() - g_ref.float()).abs() <= 2**-6 * g_ref.float().abs() + 1e-6).float().mean() > 0.999
    labels = torch.randint(0, V, (c,), generator=g, device="cuda")
    z = (torch.randn(c, V, generator=g, device="cuda") * 4).to(torch.bfloat16)
    l_ref, g_ref, a_ref = hard_rows(z.clone(), labels, torch.bfloat16)
    l, gk, a = K.hard_rows(z.clone(), labels, True)
    assert torch.equal(a, a_ref)
    torch.testing.assert_close(l, l_ref, rtol=1e-3, atol=1e-3)
