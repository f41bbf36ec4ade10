"""The fast attention paths (chunked online-softmax, torch's CPU flash kernel, flex) compute the same TTT loss and gradients
as the plain reference path; layer recompute changes nothing; the loss keeps no [T, V] copies."""

import math
import warnings

import pytest
import torch

from eaglenest.draft import kernels
from eaglenest.draft.kernels import FlexCausal, bucket_length, causal_attention_lse, causal_block_mask
from eaglenest.draft.model import DraftConfig, Eagle3Draft
from eaglenest.draft.vocab import build_vocab
from eaglenest.train.losses import TeacherRows
from eaglenest.train.ttt import Teacher, denominators, ttt_forward

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def draft(n_head=4, n_kv=2, hd=8, H=32, V=300, Vd=120, seed=0, dtype=torch.float64):
    cfg = DraftConfig(
        hidden_size=H, intermediate_size=2 * H, num_attention_heads=n_head, num_key_value_heads=n_kv, head_dim=hd,
        vocab_size=V, draft_vocab_size=Vd, target_hidden_size=H, aux_layer_ids=[1, 2, 3], target_num_layers=6,
    )
    torch.manual_seed(seed)
    d = Eagle3Draft(cfg, embed_weight=torch.randn(V, H))
    for p in d.parameters():
        torch.nn.init.normal_(p, std=0.2)
    d.set_vocab(*build_vocab(torch.randint(0, 50, (V,)), Vd))
    return d.to(dtype)


def batch(d, lengths, seed=1, dtype=torch.float64):
    """Right-padded batch (garbage in the padding) with a chat-like loss mask."""
    g = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(lengths)
    V, Vd, H = d.cfg.vocab_size, d.cfg.draft_vocab_size, d.cfg.hidden_size
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.zeros(B, T, dtype=torch.long)
    for b, L in enumerate(lengths):
        mask[b, L // 4 : L] = 1
    aux = torch.randn(B, T, 3 * H, generator=g, dtype=dtype)
    tprobs = torch.softmax(torch.randn(B, T, Vd, generator=g, dtype=dtype) * 2, -1)
    targ = torch.randint(0, V, (B, T), generator=g)
    return ids, mask, aux, tprobs, targ


def loss_and_grads(d, b, ttt, **kw):
    ids, mask, aux, tprobs, targ = b
    loss, stats = ttt_forward(d, ids, aux, TeacherRows.from_probs(tprobs, targ), mask, ttt, denominators(mask, ttt), chunk=5, **kw)
    params = [p for p in d.parameters() if p.requires_grad]
    return loss, torch.autograd.grad(loss, params), stats


@pytest.mark.parametrize(
    "n_head,n_kv,lengths,ttt",
    [(4, 2, [23, 17], 3), (8, 2, [40], 4), (4, 4, [9, 31, 20], 3), (2, 1, [33], 5)],
)
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("impl", ["chunked", "sdpa"])
def test_fast_kernels_equal_eager_loss_and_grads(n_head, n_kv, lengths, ttt, recompute, impl):
    """fp64: the chunked kernel and torch's CPU flash kernel (sdpa, whose lse gradient eaglenest adds)
    give the eager reference's loss and gradients, diagonal merges of TTT steps > 0 included."""
    d = draft(n_head=n_head, n_kv=n_kv)
    b = batch(d, lengths)
    ref, g_ref, s_ref = loss_and_grads(d, b, ttt)
    # tiny chunks: many query chunks, several of them cut through the diagonal block
    orig = kernels.chunk_rows
    kernels.chunk_rows = lambda n_kv, g, T, budget: 7
    try:
        fast, g_fast, s_fast = loss_and_grads(d, b, ttt, attn_impl=impl, recompute=recompute)
    finally:
        kernels.chunk_rows = orig
    assert torch.allclose(fast, ref, rtol=1e-10, atol=1e-12), (fast, ref)
    for a, r in zip(g_fast, g_ref):
        assert torch.allclose(a, r, rtol=1e-8, atol=1e-11)
    for k in s_ref:
        assert s_fast[k] == pytest.approx(s_ref[k], rel=1e-9)


@pytest.mark.parametrize("impl", ["chunked", "sdpa"])
def test_fast_kernels_fp32_and_bf16_autocast_within_tolerance(impl):
    d = draft(n_head=8, n_kv=2, hd=16, H=64, dtype=torch.float64)
    b64 = batch(d, [48, 30])
    ref, g_ref, _ = loss_and_grads(d, b64, 3)
    d32 = d.float()
    b32 = tuple(x.float() if x.is_floating_point() else x for x in b64)
    fast, g_fast, _ = loss_and_grads(d32, b32, 3, attn_impl=impl, recompute=True)
    fast, ref = float(fast.detach()), float(ref.detach())
    assert abs(fast - ref) < 1e-5 * abs(ref)
    for a, r in zip(g_fast, g_ref):
        assert (a.double() - r).norm() <= 1e-4 * r.norm() + 1e-9
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the CUDA recipe's dtypes, on the CPU
        eag, _, _ = loss_and_grads(d32, b32, 3)
        fb, _, _ = loss_and_grads(d32, b32, 3, attn_impl=impl)
    assert abs(float(fb.detach()) - float(eag.detach())) < 2e-2 * abs(float(eag.detach()))


def test_flex_forward_equals_eager():
    """flex has no CPU backward: compare the loss (no grad) here; tests/test_fastpath_cuda covers grads."""
    d = draft(n_head=4, n_kv=2)
    ids, mask, aux, tprobs, targ = batch(d, [37, 21])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref, _ = ttt_forward(d, ids, aux, TeacherRows.from_probs(tprobs, targ), mask, 4, denominators(mask, 4))
        fl, _ = ttt_forward(d, ids, aux, TeacherRows.from_probs(tprobs, targ), mask, 4, denominators(mask, 4), attn_impl="flex")
    assert torch.allclose(fl, ref, rtol=1e-6), (fl, ref)  # flex keeps lse in fp32


def test_causal_block_mask_matches_create_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    for T in (1, 127, 128, 300):
        ref = create_block_mask(lambda b, h, q, k: q >= k, None, None, T, T, device="cpu")
        assert torch.equal(causal_block_mask(T, "cpu").to_dense(), ref.to_dense())


@pytest.mark.parametrize("impl", ["chunked", "sdpa"])
@pytest.mark.parametrize("vd", [8, 5, 11])
@pytest.mark.parametrize("out_rows", ["all", "some"])
def test_fast_kernel_lse_gradient(impl, vd, out_rows):
    """(out, lse) of the chunked and sdpa kernels, with a gradient through lse (the merge needs it;
    torch's flash kernel takes none itself), values as wide as the keys or not (MLA).  `some`: query
    rows whose output has no gradient while their lse has one (sdpa folds dlse into O where dO is
    not 0, and takes a value column more where it is)."""
    torch.manual_seed(0)
    B, kv, g, T, hd = 2, 2, 3, 29, 8
    q = torch.randn(B, kv, g, T, hd, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, kv, T, hd, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, kv, T, vd, dtype=torch.float64, requires_grad=True)
    sc = 1 / math.sqrt(hd)
    causal = torch.ones(T, T, dtype=torch.bool).tril()

    def ref():
        s = (q @ k.unsqueeze(2).transpose(-1, -2) * sc).masked_fill(~causal, float("-inf"))
        return torch.softmax(s, -1) @ v.unsqueeze(2), s.logsumexp(-1)

    seen = torch.ones(T, 1, dtype=torch.float64)
    if out_rows == "some":
        seen[::3] = 0

    def f(out, lse):
        return (out * torch.linspace(-1, 1, vd, dtype=torch.float64) * seen).sum() + (lse * lse).sum()

    gr = torch.autograd.grad(f(*ref()), (q, k, v))
    got = causal_attention_lse(q, k, v, sc, impl, chunk_elems=100)
    assert got[1].dtype == torch.float64  # >= fp32, never narrowed
    torch.testing.assert_close(got[0], ref()[0], rtol=1e-10, atol=1e-12)
    gf = torch.autograd.grad(f(*got), (q, k, v))
    for a, b in zip(gf, gr):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def test_sdpa_is_the_cpu_bf16_default_and_refused_elsewhere():
    assert kernels.default_attn_impl("cpu", autocast=True) == "sdpa" and kernels.default_attn_impl("cpu") == "eager"
    assert kernels.default_attn_impl("cuda") == "flex" == kernels.default_attn_impl("cuda", autocast=True)
    with pytest.raises(ValueError, match="CPU kernel"):
        kernels.causal_kernel("sdpa", "cuda")


def test_decoding_path_equals_training_path_on_a_whole_sequence():
    """The two attention paths of the draft agree where they meet: a decoding step over a whole
    sequence under a causal mask, with and without a KV cache, is TTT step 0."""
    d = draft()
    T = 12
    ids = torch.randint(0, 300, (2, T))
    h = torch.randn(2, T, 32, dtype=torch.float64)
    pos = torch.arange(T).expand(2, T)
    ref, (k, v) = d.ttt_step(ids, h, pos)
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None]
    dec, _ = d.step(ids, h, pos, mask=causal)
    assert torch.allclose(dec, ref, rtol=1e-12, atol=1e-12)
    # the last 4 positions decoded against a KV cache of the first 8
    tail, _ = d.step(ids[:, 8:], h[:, 8:], pos[:, 8:], past_kv=(k[:, :, :8], v[:, :, :8]), mask=causal[:, 8:])
    assert torch.allclose(tail, ref[:, 8:], rtol=1e-12, atol=1e-12)
    fast, _ = d.ttt_step(ids, h, pos, kernel=kernels.ChunkedCausal())
    assert torch.allclose(fast, ref, rtol=1e-9, atol=1e-10)


def test_flex_lengths_are_bucketed_and_compiled_a_bounded_number_of_times():
    """Issue 13: a static compile of flex_attention recompiles for every new sequence length and,
    past torch's recompile limit, silently falls back to eager flex (every score materialized).
    FlexCausal pads T to whole 128-blocks (exact: the padded keys come after every real query)
    and compiles with dynamic shapes: 10 (batch, length) shapes compile at most 4 times (batch 1
    and single-block lengths get their own graphs), where the old static compile hits the limit."""
    compiles = []

    def counting_backend(gm, example_inputs):
        compiles.append(len(example_inputs))
        return gm.forward

    shapes = [(b, t) for t in (37, 200, 300, 513, 700) for b in (1, 2)]

    def run(kern):
        compiles.clear()
        torch.manual_seed(0)
        for B, T in shapes:
            q = torch.randn(B, 2, 2, T, 8)
            k, v = torch.randn(B, 2, T, 8), torch.randn(B, 2, T, 8)
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out, lse = kern(q, k, v, 0.35)
            assert out.shape == q.shape and lse.shape == q.shape[:-1]
            if T in (37, 513):  # exact despite the padding
                ref_out, ref_lse = kernels.ChunkedCausal()(q, k, v, 0.35)
                assert torch.allclose(out, ref_out, atol=1e-5) and torch.allclose(lse, ref_lse, atol=1e-5)
        return len(compiles)

    assert [bucket_length(t) for t in (1, 128, 129, 700)] == [128, 128, 256, 768]
    assert run(FlexCausal(compile=True, backend=counting_backend)) <= 4

    class OldStatic(FlexCausal):  # the previous setting: dynamic=False, no padding
        def __call__(self, q, k, v, scale):
            from torch.nn.attention import flex_attention as fa

            if self._compiled is None:
                self._compiled = torch.compile(fa.flex_attention, dynamic=False, backend=counting_backend)
            B, n_kv, g, T, hd = q.shape
            out, aux = self._compiled(q.reshape(B, n_kv * g, T, hd), k, v, block_mask=causal_block_mask(T, q.device), scale=scale,
                                      enable_gqa=True, return_aux=fa.AuxRequest(lse=True))
            return out.reshape(q.shape), aux.lse.reshape(q.shape[:-1])

    torch.compiler.reset()
    assert run(OldStatic()) >= 8  # the harness sees the old recompiles (limit 8: the rest ran eager)


def test_teacher_is_computed_once_and_not_copied_per_step():
    """No [T, Vd] tensor is saved for backward per TTT step: saved-tensor bytes grow with ttt by
    about the per-step activations only (hidden-sized), not by the teacher's size."""
    d = draft(H=16, V=2500, Vd=2000, n_head=2, n_kv=1, hd=8, dtype=torch.float32)
    ids, mask, aux, tprobs, targ = batch(d, [64], dtype=torch.float32)
    teacher = TeacherRows.from_probs(tprobs, targ)

    def saved_bytes(ttt):
        seen = {}

        def pack(t):
            seen[(t.data_ptr(), t.untyped_storage().nbytes())] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            ttt_forward(d, ids, aux, teacher, mask, ttt, denominators(mask, ttt), chunk=16, attn_impl="chunked")
        return sum(v for (ptr, n), v in seen.items() if ptr != teacher.logits.data_ptr())

    per_step = saved_bytes(3) - saved_bytes(2)
    teacher_bytes = tprobs.numel() * 4
    assert per_step < teacher_bytes / 2, (per_step, teacher_bytes)


def test_teacher_targets_chunked_bf16():
    g = torch.Generator().manual_seed(0)
    V, H, Vd = 500, 32, 200
    W = torch.randn(V, H, generator=g)
    rows = torch.randperm(V, generator=g)[:Vd].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[rows] = True
    h = torch.randn(50, H, generator=g)
    all_rows = torch.arange(50)
    t = Teacher(None, 1e-6, W, rows, t2d)
    r = t.targets(h, chunk=7, mass=True)
    full = torch.log_softmax(h @ W.T, -1)
    assert torch.allclose(r.probs(all_rows), torch.softmax(h @ W[rows].T, -1), atol=1e-6)
    assert torch.equal(r.argmax, (h @ W.T).argmax(-1))
    # log-mass: the target's full-vocabulary probability inside the draft vocabulary
    assert torch.allclose(r.log_mass, full[:, rows].logsumexp(-1), atol=1e-5)
    assert torch.allclose(r.probs(all_rows) * r.log_mass.exp()[:, None], full[:, rows].exp(), atol=1e-6)
    tb = Teacher(None, 1e-6, W, rows, t2d, matmul_dtype=torch.bfloat16)
    rb = tb.targets(h)
    assert rb.logits.dtype == torch.bfloat16 and rb.log_mass is None  # no fp32 [N, Vd] copy is kept
    assert (rb.probs(all_rows) - r.probs(all_rows)).abs().max() < 0.05 and (rb.argmax == r.argmax).float().mean() > 0.9
    # a known argmax and log-mass (from an earlier epoch) are used as given: the full-vocabulary head is skipped
    known, lm = torch.randint(0, V, (50,), generator=g), -torch.rand(50, generator=g)
    r2 = t.targets(h, argmax=known, mass=True, log_mass=lm)
    assert torch.equal(r2.argmax, known) and torch.equal(r2.log_mass, lm) and torch.allclose(r2.probs(all_rows), r.probs(all_rows), atol=1e-7)
    # a draft vocabulary that is the whole vocabulary (Kimi's published drafts): one head, mass 1
    tf = Teacher(None, 1e-6, W, torch.arange(V), torch.ones(V, dtype=torch.bool))
    rf = tf.targets(h, chunk=9, mass=True)
    assert tf.heads()[1].numel() == 0 and tf.heads()[0].data_ptr() == tf.lm_head.data_ptr()  # one head, no copy
    assert torch.equal(rf.argmax, r.argmax) and torch.equal(rf.log_mass, torch.zeros(50))


def test_teacher_argmax_ties_across_the_draft_vocabulary():
    """The teacher computes the draft rows' logits and the other rows' apart (each logit once); its
    argmax is still the first maximum in target order, as torch's max over the whole row, with the
    maximum tied between a draft row and another row below or above it.  Integer values: every logit
    is exact, whatever the matmuls' order of summation."""
    g = torch.Generator().manual_seed(3)
    V, H = 64, 8
    W = torch.randint(-5, 6, (V, H), generator=g).double()
    W[2] = W[3] = 10 * torch.eye(H, dtype=torch.float64)[0]  # 3 in the draft vocabulary, 2 (below it) not
    W[40] = W[41] = 10 * torch.eye(H, dtype=torch.float64)[1]  # 40 in it, 41 (above it) not
    rows = torch.tensor([3, 10, 20, 40, 50])
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[rows] = True
    h = torch.cat([torch.eye(H, dtype=torch.float64)[:2], torch.randint(-2, 3, (30, H), generator=g).double()])
    r = Teacher(None, 1e-6, W, rows, t2d, matmul_dtype=torch.float64).targets(h, chunk=7, mass=True)
    z = h @ W.T
    assert torch.equal(r.argmax, z.max(-1).indices) and r.argmax[:2].tolist() == [2, 40]
    assert torch.equal(r.logits, z[:, rows])
    torch.testing.assert_close(r.log_mass, torch.log_softmax(z, -1)[:, rows].logsumexp(-1).float())  # kept in fp32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (flex backward is CUDA-only)")
@pytest.mark.parametrize("impl", ["flex", "chunked"])
def test_cuda_fast_paths_equal_eager(impl):
    d = draft(n_head=8, n_kv=2, hd=16, H=64, dtype=torch.float32).cuda()
    b = tuple(x.cuda() for x in batch(d, [150, 90], dtype=torch.float32))
    ref, g_ref, _ = loss_and_grads(d, b, 4)
    fast, g_fast, _ = loss_and_grads(d, b, 4, attn_impl=impl, recompute=True)
    assert abs(float(fast) - float(ref)) < 1e-4 * abs(float(ref))
    for a, r in zip(g_fast, g_ref):
        assert (a - r).norm() <= 2e-3 * r.norm() + 1e-7
