"""The training losses (eaglenest/train/losses.py) against slow fp64 references written with
autograd (values and gradients, the stop-gradient in lk_hybrid's lambda included); `ce` against
the previous implementation (the demo's tau was measured with it); `--loss` parsing; the memory
bound at Kimi-K2.5's vocabulary."""

from __future__ import annotations

import pytest
import torch

from eaglenest import EaglenestError
from eaglenest.train.losses import ROW_MAX_BLOCK, LossSpec, SoftTarget, TeacherRows, head_loss, loss_step_bytes, row_max

pytestmark = pytest.mark.usefixtures("one_torch_thread")

def chunk_loss(z, teacher, trows, w, spec, want_alpha=False):
    """The fused head + loss on logits z itself (an identity head, so d/dh is d/dz), in chunks of 7
    rows: (sum_i w_i loss_i, argmax, alpha, p(argmax))."""
    val, _, arg, alpha, p_arg = head_loss(z, torch.eye(z.shape[1], dtype=z.dtype), SoftTarget(teacher, trows, spec), w, 7, want_alpha)
    return val, arg, alpha, p_arg


MIXES = ["ce", "kl", "tv", "nla", "lk_hybrid", "ce:0.1,tv:0.9", "kl:0.5,nla:2,lk_hybrid:0.25"]


def problem(seed=0, N=40, V=90, Vd=60, c=25, softcap=None, dtype=torch.float64):
    """Draft logits z [c, Vd], the target's FULL-vocabulary logits [N, V], the draft vocabulary's
    rows, and c teacher rows (shuffled, as TTT reads them) with weights."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(N, V, generator=g, dtype=dtype) * 2.5
    vocab = torch.randperm(V, generator=g)[:Vd].sort().values
    z = (torch.randn(c, Vd, generator=g, dtype=dtype) * 2).requires_grad_()
    trows = torch.randperm(N, generator=g)[:c]
    w = torch.rand(c, generator=g, dtype=dtype) + 0.5
    capped = full if not softcap else (full / softcap).tanh() * softcap
    teacher = TeacherRows(full[:, vocab], full.argmax(-1), torch.logsumexp(capped[:, vocab], -1) - torch.logsumexp(capped, -1), softcap)
    return z, capped, vocab, trows, w, teacher


def reference(z, capped, vocab, trows, w, spec: LossSpec, detach_lambda=True):
    """Plain definitions: p = the target's full-vocabulary softmax restricted to the draft
    vocabulary (not renormalized), p^ = p renormalized, q = softmax(z)."""
    p = torch.softmax(capped[trows], -1)[:, vocab]
    ph = p / p.sum(-1, keepdim=True)
    logq = torch.log_softmax(z, -1)
    q = logq.exp()
    alpha = torch.minimum(p, q).sum(-1)
    ce = -(ph * logq).sum(-1)
    kl = (ph * (ph.log() - logq)).sum(-1)
    tv = 0.5 * ((p - q).abs().sum(-1) + (1 - p.sum(-1)))  # over the full vocabulary: q is 0 outside the draft's
    lam = torch.exp(-spec.eta * (alpha.detach() if detach_lambda else alpha))
    per = {"ce": ce, "kl": kl, "tv": tv, "nla": -alpha.log(), "lk_hybrid": lam * kl + (1 - lam) * tv}
    return (w * sum(c * per[k] for k, c in spec.terms)).sum(), alpha, p.gather(1, z.argmax(-1)[:, None])[:, 0]


@pytest.mark.parametrize("softcap", [None, 4.0])
@pytest.mark.parametrize("mix", MIXES)
def test_loss_matches_fp64_reference(mix, softcap):
    spec = LossSpec.parse(mix, eta=2.5)
    z, capped, vocab, trows, w, teacher = problem(softcap=softcap)
    val, arg, alpha, p_arg = chunk_loss(z, teacher, trows, w, spec, want_alpha=True)
    (g,) = torch.autograd.grad(val, z)
    ref, ref_alpha, ref_p_arg = reference(z, capped, vocab, trows, w, spec)
    (g_ref,) = torch.autograd.grad(ref, z)
    torch.testing.assert_close(val, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(alpha, ref_alpha, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(p_arg, ref_p_arg, rtol=1e-12, atol=1e-14)
    assert torch.equal(arg, z.argmax(-1))
    assert g.abs().max() > 1e-3  # a real gradient


def test_lambda_is_a_stop_gradient():
    """lk_hybrid's lambda = exp(-eta * sg(alpha)): its gradient is the detached reference's, and
    measurably not the gradient through lambda (so the test can tell them apart)."""
    spec = LossSpec.parse("lk_hybrid", eta=3.0)
    z, capped, vocab, trows, w, teacher = problem(seed=3)
    (g,) = torch.autograd.grad(chunk_loss(z, teacher, trows, w, spec)[0], z)
    (g_sg,) = torch.autograd.grad(reference(z, capped, vocab, trows, w, spec, detach_lambda=True)[0], z)
    (g_through,) = torch.autograd.grad(reference(z, capped, vocab, trows, w, spec, detach_lambda=False)[0], z)
    torch.testing.assert_close(g, g_sg, rtol=1e-9, atol=1e-12)
    assert (g - g_through).norm() > 0.05 * g.norm()


def test_alpha_uses_the_unrenormalized_target():
    """alpha is bounded by the target's mass inside the draft vocabulary: a draft equal to the
    renormalized target is accepted with probability S, not 1."""
    z, capped, vocab, trows, w, teacher = problem(seed=5)
    ph = teacher.probs(trows)
    _, _, alpha, _ = chunk_loss(ph.log(), teacher, trows, w, LossSpec(), want_alpha=True)
    S = teacher.log_mass[trows].exp()
    assert S.max() < 0.999 and S.mean() < 0.9  # the check below is not vacuous
    torch.testing.assert_close(alpha, S, rtol=1e-12, atol=1e-14)


def test_nla_gradient_stays_bounded_at_tiny_alpha():
    z, capped, vocab, trows, w, teacher = problem(seed=7)
    far = (-teacher.probs(trows).log() * 8).detach().requires_grad_()  # q puts its mass where p has little
    val, _, alpha, _ = chunk_loss(far, teacher, trows, torch.ones_like(w), LossSpec.parse("nla"), want_alpha=True)
    (g,) = torch.autograd.grad(val, far)
    assert alpha.min() < 1e-3 and torch.isfinite(g).all() and g.abs().sum(-1).max() <= 2 + 1e-9


# --- ce is what it was: a frozen copy of the previous teacher + SoftCrossEntropy ---------------------


class PreviousSoftCE(torch.autograd.Function):
    """eaglenest/train/ttt.py's SoftCrossEntropy before the loss module (commit b841df4), verbatim."""

    @staticmethod
    def forward(ctx, logits, teacher, rows, w):
        z = logits.to(torch.promote_types(logits.dtype, torch.float32))
        lse = torch.logsumexp(z, dim=-1)
        ce = lse - torch.linalg.vecdot(z, teacher.index_select(0, rows).to(z.dtype))
        ctx.save_for_backward(z, teacher, rows, w, lse)
        ctx.in_dtype = logits.dtype
        arg = z.max(dim=-1).indices
        ctx.mark_non_differentiable(arg)
        return (ce * w).sum(), arg

    @staticmethod
    def backward(ctx, g, _g_arg):
        z, teacher, rows, w, lse = ctx.saved_tensors
        z = z.clone() if z.dtype == ctx.in_dtype else z
        grad = z.sub_(lse[:, None]).exp_().sub_(teacher.index_select(0, rows).to(z.dtype)).mul_((w.to(z.dtype) * g)[:, None])
        return grad.to(ctx.in_dtype), None, None, None


def previous_teacher_probs(h, W, rows, dtype):
    """The previous Teacher.targets' probabilities: softmax of the draft rows' logits, fp32, [N, Vd]."""
    return torch.softmax((h.to(dtype) @ W.to(dtype)[rows].T).float(), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ce_is_numerically_the_previous_ce(dtype):
    """The default loss, through the new teacher representation (draft-vocabulary logits in the
    matmul dtype, probabilities per chunk), gives the previous values and gradients to fp32
    rounding, in fp32 and under the demo's bf16 (teacher matmul and draft logits in bf16)."""
    from eaglenest.train.ttt import Teacher

    g = torch.Generator().manual_seed(11)
    V, Vd, H, N, c = 700, 300, 48, 96, 40
    W = torch.randn(V, H, generator=g)
    rows = torch.randperm(V, generator=g)[:Vd].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[rows] = True
    h = torch.randn(N, H, generator=g) * 0.5
    teacher = Teacher(None, 1e-6, W, rows, t2d, matmul_dtype=dtype).targets(h, chunk=37)
    old_probs = previous_teacher_probs(h, W, rows, dtype)
    torch.testing.assert_close(teacher.probs(torch.arange(N)), old_probs, rtol=0, atol=0)  # the same teacher, exactly
    trows = torch.randperm(N, generator=g)[:c]
    w = torch.rand(c, generator=g)
    logits = (torch.randn(c, Vd, generator=g) * 3).to(dtype).requires_grad_()
    new, a_new, _, _ = chunk_loss(logits, teacher, trows, w, LossSpec.parse("ce"))
    old, a_old = PreviousSoftCE.apply(logits, old_probs, trows, w)
    (g_new,) = torch.autograd.grad(new, logits)
    (g_old,) = torch.autograd.grad(old, logits)
    torch.testing.assert_close(new, old, rtol=1e-6, atol=0)
    # the gradient: q as exp(z - max) / sum instead of exp(z - lse) (fp32 rounding apart), and the row's
    # weight applied to the head's [rows, H] product instead of the [rows, Vd] logits gradient: in bf16
    # that is one more bf16 rounding here, where the identity head makes the product exact: the two are at
    # most three half-ulps (3 * 2^-8 relative) apart
    if dtype == torch.bfloat16:
        torch.testing.assert_close(g_new.float(), g_old.float(), rtol=3 * 2**-8, atol=1e-9)
    else:
        torch.testing.assert_close(g_new, g_old, rtol=1e-5, atol=1e-8)
    assert torch.equal(a_new, a_old)


# --- the option ---------------------------------------------------------------------------------------


def test_loss_option_parsing(tmp_path):
    from eaglenest.config import read_yaml
    from eaglenest.train.config import TrainConfig

    assert str(LossSpec.parse("ce")) == "ce" and LossSpec.parse("lk_hybrid").needs_alpha
    s = LossSpec.parse(" ce:0.1, tv:0.9 ")
    assert s.terms == (("ce", 0.1), ("tv", 0.9)) and str(s) == "ce:0.1,tv:0.9" and s.needs_alpha
    assert not LossSpec.parse("ce:1,kl:2").needs_alpha
    for bad, msg in (("mse", "unknown loss"), ("ce:x", "not a number"), ("ce:-1", "positive"), ("ce,ce:2", "twice"), ("", "empty")):
        with pytest.raises(EaglenestError, match=msg):
            LossSpec.parse(bad)
    f = tmp_path / "run.yaml"
    f.write_text("loss: ce:0.1,tv:0.9\nlk_eta: 2.0\nstep_decay: 0.7\n")  # the YAML form is the flag's string
    assert read_yaml(f, TrainConfig) == {"loss": "ce:0.1,tv:0.9", "lk_eta": 2.0, "step_decay": 0.7}
    f.write_text("model: m\nout: o\nfeatures: f\nloss: tv:2,bogus\n")
    with pytest.raises(EaglenestError, match=r"run\.yaml:4: loss: .*unknown loss 'bogus'"):
        read_yaml(f, TrainConfig)
    cfg = TrainConfig(model="m", out="o", features="f", loss="lk_hybrid", lk_eta=-1.0)
    with pytest.raises(EaglenestError, match="lk-eta"):
        cfg.validate()


# --- memory at Kimi-K2.5's vocabulary -----------------------------------------------------------------


def step_bytes(N: int, V: int, Vd: int, H: int, device: str, spec: LossSpec, chunk: int | None = None) -> dict:
    """Tensor bytes of Teacher.targets of N final states (bf16 matmuls, as under `--dtype auto` on
    CUDA) and one fused head + loss step over N rows, forward and backward, counted op by op
    (train/memtrace.py); on the meta device nothing is allocated."""
    from eaglenest.train.losses import chunk_rows
    from eaglenest.train.memtrace import LiveTensorBytes
    from eaglenest.train.ttt import TEACHER_CHUNK_ELEMS, Teacher

    bf = torch.bfloat16
    W, last, hidden = (torch.empty(n, H, dtype=bf, device=device) for n in (V, N, N))
    head = torch.empty(Vd, H, dtype=bf, device=device)
    t2d = torch.zeros(V, dtype=torch.bool, device=device)
    t2d[:Vd] = True
    if device != "meta":
        for t in (W, last, head, hidden):
            torch.nn.init.normal_(t, std=0.02, generator=torch.Generator().manual_seed(0))
    head.requires_grad_(True)
    head.grad = torch.zeros_like(head)  # the accumulated gradient is model memory; each chunk's own [Vd, H] is the step's
    hidden.requires_grad_(True)
    teacher = Teacher(None, 1e-6, W, torch.arange(Vd, device=device), t2d, matmul_dtype=bf)
    teacher.heads()  # the draft-rows head is model memory, not the step's
    c = chunk or chunk_rows(4096, Vd)
    with LiveTensorBytes() as m:
        t = teacher.targets(last, mass=spec.needs_alpha)
        kept = m.live
        head_loss(hidden, head, SoftTarget(t, torch.arange(N, device=device), spec), torch.ones(N, device=device), c)[0].backward()
    return {"peak_bytes": m.peak, "teacher_kept_bytes": kept, "largest_by_dtype": {k: list(v) for k, v in m.largest_by_dtype.items()},
            "loss_chunk_rows": c, "teacher_chunk_rows": max(1, TEACHER_CHUNK_ELEMS // V)}


def test_the_meta_device_counts_what_the_cpu_allocates():
    """The Kimi-sized count below runs on the meta device: the same step on real CPU tensors at a
    reduced size allocates the same tensor bytes, op by op."""
    spec = LossSpec.parse("lk_hybrid")
    cpu, meta = (step_bytes(1024, 16_384, 16_384, 256, d, spec, chunk=256) for d in ("cpu", "meta"))
    assert cpu["peak_bytes"] == meta["peak_bytes"] > 0 and cpu["teacher_kept_bytes"] == meta["teacher_kept_bytes"]


@pytest.mark.parametrize("mix", ["ce", "lk_hybrid"])
def test_kimi_vocabulary_step_memory_is_bounded(mix):
    """Teacher + one loss step at 163,840 tokens of vocabulary and 8192 tokens, bf16, counted op by
    op on the meta device: within loss_step_bytes, and no fp32 tensor of [tokens, vocab] anywhere
    (the largest fp32 one is a loss chunk's).  The teacher before this one kept fp32 probabilities
    and ran 8192-row chunks: about twice the bytes, counted the same way by the retired probe
    loss_memory (git show afe579c:bench/results/loss_memory.json)."""
    N, V = 8192, 163_840
    spec = LossSpec.parse(mix)
    r = step_bytes(N, V, V, 7168, "meta", spec)
    bound = loss_step_bytes(N, V, V, 7168, r["loss_chunk_rows"], r["teacher_chunk_rows"], spec.needs_alpha, spec.needs_alpha)
    assert 0.6 * bound <= r["peak_bytes"] <= bound, (r["peak_bytes"], bound)
    fp32 = r["largest_by_dtype"]["float32"][0]
    assert fp32 <= r["loss_chunk_rows"] * V * 4 < N * V * 4 / 8, r["largest_by_dtype"]
    assert r["teacher_kept_bytes"] <= N * (2 * V + 12)  # bf16 logits, argmax, log-mass


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [300, 2 * ROW_MAX_BLOCK, 8000, 8192, 49152])
def test_row_max_is_torch_max(dtype, width):
    """The blocked argmax (teacher and draft logits) gives torch's values and indices: the first
    maximum of a row, ties inside a block, across blocks and in a short tail included."""
    g = torch.Generator().manual_seed(width)
    z = (torch.randn(64, width, generator=g) * 3).to(dtype)
    z[1] = 0.0  # every column ties: index 0
    z[2, -1] = z[2, 5] = 100.0  # the first of two maxima, in the first block and the last column (the tail, where there is one)
    z[3, width // 2] = z[3, width - 2] = 100.0  # two blocks hold the maximum
    z[4, 7] = z[4, 9] = 100.0  # a tie inside one block
    z[5] = float("-inf")
    z[5, width - 1] = 1.0  # the last column
    z[6] = torch.round(z[6])  # many ties at a coarse grid
    for x in (z, torch.cat([z, z], 1)[:, 3 : 3 + width]):  # contiguous, and a strided view
        v, i = row_max(x)
        ref = x.max(-1)
        assert torch.equal(i, ref.indices) and torch.equal(v, ref.values)
