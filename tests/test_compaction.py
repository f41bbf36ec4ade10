"""Row compaction (train/compaction.py): from TTT step 1 on only the rows with a loss at that step or a
later one are computed (at step 0 all rows' keys and values, the rest of the layer at rows some step reads), and the loss, the gradients and every logged statistic are those of computing
every row (fp64; GQA and MLA drafts; several samples per micro-batch, all-prompt and all-answer ones;
every attention kernel); the teacher read at its needed rows only gives the same."""

from __future__ import annotations

import pytest
import torch
from test_draft_kinds import KINDS, YARN, tiny

from eaglenest.draft import kernels
from eaglenest.train.compaction import plan_rows
from eaglenest.train.losses import LossSpec, TeacherRows
from eaglenest.train.ttt import denominators, ttt_forward

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ATTN = {"gqa": {}, "mla": KINDS["mla"], "eagle31": KINDS["eagle31"]}


def batch(d, seed=3):
    """Four samples: a chat (prompt, answer, prompt, answer), one all prompt, one all answer, a short one;
    right-padded with garbage."""
    g = torch.Generator().manual_seed(seed)
    lengths = [19, 11, 14, 6]
    B, T = len(lengths), max(lengths)
    c = d.cfg
    ids = torch.randint(0, c.vocab_size, (B, T), generator=g)
    mask = torch.zeros(B, T, dtype=torch.long)
    mask[0, 4:9] = 1
    mask[0, 13:19] = 1
    mask[2, :14] = 1
    mask[3, 2:6] = 1
    aux = torch.randn(B, T, 3 * c.target_hidden_size, generator=g, dtype=torch.float64)
    tlogp = torch.log_softmax(torch.randn(B, T, c.draft_vocab_size, generator=g, dtype=torch.float64) * 2, -1)
    targ = torch.randint(0, c.vocab_size, (B, T), generator=g)
    log_mass = -torch.rand(B, T, generator=g, dtype=torch.float64)
    return ids, mask, aux, TeacherRows.from_probs(tlogp.exp(), targ, log_mass)


def run(d, ids, mask, aux, teacher, ttt, compact, impl="eager", loss="ce", **kw):
    plan = plan_rows(mask, ttt, compact=compact)
    total, stats = ttt_forward(d, ids, aux, teacher, mask, ttt, denominators(mask, ttt), chunk=5, attn_impl=impl,
                               loss=LossSpec.parse(loss), want_alpha=True, plan=plan, **kw)
    return total, torch.autograd.grad(total, list(d.parameters())), stats, plan


@pytest.mark.parametrize("attention", list(ATTN))
@pytest.mark.parametrize("impl", ["eager", "chunked", "sdpa"])
@pytest.mark.parametrize("loss", ["ce", "lk_hybrid"])
def test_compacted_rows_equal_every_row(attention, impl, loss):
    d = tiny(ATTN[attention], rope=YARN if attention == "mla" else None)
    ids, mask, aux, teacher = batch(d)
    ttt = 4
    kern = kernels.ChunkedCausal(chunk_elems=48) if impl == "chunked" else impl  # several query chunks
    full, g_full, s_full, p_full = run(d, ids, mask, aux, teacher, ttt, False, kern, loss)
    comp, g_comp, s_comp, p_comp = run(d, ids, mask, aux, teacher, ttt, True, kern, loss)
    torch.testing.assert_close(comp, full, rtol=1e-12, atol=1e-14)
    for (name, _), a, b in zip(d.named_parameters(), g_comp, g_full):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-13, msg=name)
    assert s_comp.keys() == s_full.keys() and set(s_comp) >= {"loss_sum", "correct", "count", "loss_count", "alpha_sum", "p_argmax_sum"}
    for k in s_comp:
        assert s_comp[k] == pytest.approx(s_full[k], rel=1e-10, abs=1e-12), k
    B, T = ids.shape
    real = lambda p: B * T + sum(s.idx.unique().numel() for s in p.steps)  # noqa: E731 -- without the bucket's repeats
    assert real(p_full) == ttt * B * T
    assert real(p_comp) < 0.8 * real(p_full)  # the prompt, the padding and the tails are skipped
    assert p_full.keep0 is None and p_comp.keep0.unique().numel() < 0.5 * B * T  # step 0's layer past its keys too
    assert all(g.abs().sum() > 0 for g in g_comp)


def test_recompute_and_the_compact_teacher_change_nothing():
    """Per-step activation checkpointing over compacted steps, and a teacher holding only the rows a step
    reads (what the trainer passes), give the same loss and gradients."""
    d = tiny({})
    ids, mask, aux, teacher = batch(d, seed=5)
    ttt = 3
    ref, g_ref, s_ref, plan = run(d, ids, mask, aux, teacher, ttt, True)
    q = plan.teacher_rows
    small = TeacherRows(teacher.logits[q], teacher.argmax[q], teacher.log_mass[q])
    assert q.numel() < ids.numel()
    for kw, t in (({"recompute": True}, teacher), ({"compact_teacher": True}, small)):
        out, g, s, _ = run(d, ids, mask, aux, t, ttt, True, **kw)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-14)
        for a, b in zip(g, g_ref):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-13)
        assert all(s[k] == pytest.approx(s_ref[k]) for k in s_ref)
    with pytest.raises(ValueError, match="teacher has"):
        ttt_forward(d, ids, aux, TeacherRows(teacher.logits[:3], teacher.argmax[:3]), mask, ttt, denominators(mask, ttt))
    with pytest.raises(ValueError, match="every position"):  # a compact teacher is said to be one, never guessed
        ttt_forward(d, ids, aux, small, mask, ttt, denominators(mask, ttt))


def test_a_compact_teacher_as_long_as_the_batch():
    """A batch that is nearly all answer: the plan's teacher rows, rounded up to a whole bucket, are as
    many as the batch's positions (62 read, 64 kept).  The compact teacher is still read through the
    plan's index: the loss, gradients and statistics are the full teacher's.  (Inferring the layout
    from the row count read row q of the compact teacher as position q: 43 of 974 positions of a
    demo-recipe batch had their in-vocabulary weight from another token, and held-out accuracy fell.)"""
    d = tiny({})
    g = torch.Generator().manual_seed(11)
    B, T, c = 1, 64, d.cfg
    ids = torch.randint(0, c.vocab_size, (B, T), generator=g)
    mask = torch.zeros(B, T, dtype=torch.long)
    mask[0, 2:] = 1
    aux = torch.randn(B, T, 3 * c.target_hidden_size, generator=g, dtype=torch.float64)
    tlogp = torch.log_softmax(torch.randn(B, T, c.draft_vocab_size, generator=g, dtype=torch.float64) * 2, -1)
    targ = torch.randint(0, c.vocab_size, (B, T), generator=g)  # 120 of 300 ids in the draft vocabulary
    teacher = TeacherRows.from_probs(tlogp.exp(), targ, -torch.rand(B, T, generator=g, dtype=torch.float64))
    ref, g_ref, s_ref, plan = run(d, ids, mask, aux, teacher, 3, True)
    q = plan.teacher_rows
    assert q.unique().numel() == 62 and q.numel() == B * T  # the case a row count cannot tell apart
    small = TeacherRows(teacher.logits[q], teacher.argmax[q], teacher.log_mass[q])
    out, g, s, _ = run(d, ids, mask, aux, small, 3, True, compact_teacher=True)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-14)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-13)
    assert all(s[k] == pytest.approx(s_ref[k]) for k in s_ref)
    assert 0 < s_ref["loss_count"][0] < s_ref["count"][0]  # some positions without a loss: the weights were tested


def test_a_batch_whose_later_steps_have_no_rows():
    """Answers at the start: step 2 on has no loss row; those steps are skipped, their stats are 0."""
    d = tiny({})
    ids, mask, aux, teacher = batch(d, seed=7)
    mask = torch.zeros_like(mask)
    mask[0, 2] = mask[1, 3] = 1  # predicted by step 0 (rows 0 and 1) and, for sample 1, step 1 (row 0)
    plan = plan_rows(mask, 4)
    assert plan.counts == [2, 1, 0, 0] and len(plan.steps) == 1
    total, g, stats, _ = run(d, ids, mask, aux, teacher, 4, True)
    full, g_full, s_full, _ = run(d, ids, mask, aux, teacher, 4, False)
    torch.testing.assert_close(total, full, rtol=1e-12, atol=1e-14)
    assert all(stats[k] == pytest.approx(s_full[k]) for k in s_full) and stats["count"] == [float(c) for c in plan.counts]


def test_flex_forward_with_compacted_queries_equals_eager():
    d = tiny({})
    ids, mask, aux, teacher = batch(d, seed=9)
    with torch.no_grad():
        ref, _ = ttt_forward(d, ids, aux, teacher, mask, 3, denominators(mask, 3))
        fl, _ = ttt_forward(d, ids, aux, teacher, mask, 3, denominators(mask, 3), attn_impl=kernels.FlexCausal(compile=False))
    torch.testing.assert_close(fl, ref, rtol=1e-10, atol=1e-12)
