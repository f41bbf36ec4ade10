"""TTT masks, shifts and attention against a slow, plainly written reference; the loss-mask
alignment; fast path == reference path in loss and gradients."""

import math

import pytest
import torch

from eaglenest.draft.model import Eagle3Config, Eagle3Draft, apply_rope
from eaglenest.draft.vocab import build_vocab
from eaglenest.train.losses import TeacherRows
from eaglenest.train.compaction import plan_rows
from eaglenest.train.ttt import ttt_forward


def tiny_draft(seed=0, V=300, Vd=120):
    cfg = Eagle3Config(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        vocab_size=V, draft_vocab_size=Vd, target_hidden_size=32, aux_layer_ids=[2, 4, 5], target_num_layers=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    torch.manual_seed(seed)
    d = Eagle3Draft(cfg, embed_weight=torch.randn(V, 32))
    for p in d.parameters():
        torch.nn.init.normal_(p, std=0.2)
    counts = torch.randint(0, 50, (V,))
    d.set_vocab(*build_vocab(counts, Vd))
    return d.double()


def reference_loss(d: Eagle3Draft, ids, aux, tlogp, targ, mask, ttt, denom, kind="ce", log_mass=None, decay=0.8, eta=3.0,
                   alphas=None):
    """One sample, every index and every key written out by hand.  kind: the per-position loss
    (ce, or an LK loss with p = exp(tlogp + log_mass), the target's unrenormalized probabilities);
    `alphas`: a list per step that collects (alpha, counted) of every position."""
    T = ids.shape[0]
    mid, at = d.midlayer, d.midlayer.self_attn
    g = at.n_head // at.n_kv
    hidden = d.fuse(aux)
    step_keys = []  # per step: (K [T, n_kv, hd], V)
    total = 0.0
    for j in range(ttt):
        tok = torch.tensor([ids[t + 1 + j] if t + 1 + j < T else 0 for t in range(T)])
        pos = torch.tensor([t + j for t in range(T)])
        x = torch.cat([mid.input_layernorm(d.embed(tok).to(hidden.dtype)), mid.hidden_norm(hidden)], -1)
        cos, sin = d.rotary(pos[None])
        q = apply_rope(at.q_proj(x).view(1, T, at.n_head, at.hd).transpose(1, 2), cos, sin)[0]  # [h, T, hd]
        k = apply_rope(at.k_proj(x).view(1, T, at.n_kv, at.hd).transpose(1, 2), cos, sin)[0]
        v = at.v_proj(x).view(T, at.n_kv, at.hd).transpose(0, 1)
        step_keys.append((k, v))
        outs = []
        for t in range(T):
            heads = []
            for hh in range(at.n_head):
                kv = hh // g
                K = [step_keys[0][0][kv, s] for s in range(t + 1)] + [step_keys[i][0][kv, t] for i in range(1, j + 1)]
                Vv = [step_keys[0][1][kv, s] for s in range(t + 1)] + [step_keys[i][1][kv, t] for i in range(1, j + 1)]
                sc = torch.stack([q[hh, t] @ kk for kk in K]) / math.sqrt(at.hd)
                p = torch.softmax(sc, 0)
                heads.append(sum(pi * vi for pi, vi in zip(p, Vv)))
            outs.append(torch.cat(heads))
        a = at.o_proj(torch.stack(outs))
        h = hidden + a
        h = h + mid.mlp(mid.post_attention_layernorm(h))
        logp = torch.log_softmax(d.logits(h), -1)
        lsum = 0.0
        for t in range(T):
            if t + 2 + j >= T:
                continue  # the label x_{t+2+j} does not exist
            w = float(mask[t + 2 + j]) * float(d.t2d[targ[t + 1 + j]])
            ph = tlogp[t + 1 + j].exp()
            if kind == "ce":
                lsum = lsum + w * -(ph * logp[t]).sum()
                continue
            p = ph * log_mass[t + 1 + j].exp()
            alpha = torch.minimum(p, logp[t].exp()).sum()
            if alphas is not None:
                alphas[j].append((float(alpha), float(mask[t + 2 + j])))
            if kind == "nla":
                lsum = lsum - w * alpha.log()
            else:  # lk_hybrid
                lam = torch.exp(-eta * alpha.detach())
                lsum = lsum + w * (lam * (ph * (ph.log() - logp[t])).sum() + (1 - lam) * (1 - alpha))
        total = total + decay**j * lsum / max(float(denom[j]), 1.0)
        hidden = h
    return total


def make_batch(d, lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(lengths)
    V, Vd = d.cfg.vocab_size, d.cfg.draft_vocab_size
    ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.long)
    for b, L in enumerate(lengths):
        ids[b, :L] = torch.randint(0, V, (L,), generator=g)
        mask[b, L // 3 : L] = 1
    aux = torch.randn(B, T, 96, generator=g, dtype=torch.float64)
    tlogp = torch.log_softmax(torch.randn(B, T, Vd, generator=g, dtype=torch.float64) * 2, -1)
    targ = torch.randint(0, V, (B, T), generator=g)
    return ids, mask, aux, tlogp, targ


def test_fast_ttt_equals_reference_loss_and_grads():
    d = tiny_draft()
    lengths, ttt = [11, 7], 3
    ids, mask, aux, tlogp, targ = make_batch(d, lengths)
    from eaglenest.train.ttt import denominators

    denom = denominators(mask, ttt)
    fast, _ = ttt_forward(d, ids, aux, TeacherRows.from_probs(tlogp.exp(), targ), mask, ttt, denom, chunk=4)
    g_fast = torch.autograd.grad(fast, list(d.parameters()))
    ref = sum(
        reference_loss(d, ids[b, :L], aux[b, :L], tlogp[b, :L], targ[b, :L], mask[b, :L], ttt, denom)
        for b, L in enumerate(lengths)
    )
    g_ref = torch.autograd.grad(ref, list(d.parameters()))
    assert torch.allclose(fast, ref, rtol=1e-9, atol=1e-10), (fast, ref)
    for a, b in zip(g_fast, g_ref):
        assert torch.allclose(a, b, rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("kind", ["nla", "lk_hybrid"])
def test_fast_ttt_equals_reference_for_lk_losses(kind):
    """An LK loss through the TTT loop (teacher rows, chunks, weights, --step-decay) and the alpha
    it reports per step, against the slow reference."""
    from eaglenest.train.losses import LossSpec
    from eaglenest.train.ttt import denominators

    d = tiny_draft(seed=2)
    lengths, ttt = [10, 8], 3
    ids, mask, aux, tlogp, targ = make_batch(d, lengths, seed=5)
    log_mass = -torch.rand(ids.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    denom = denominators(mask, ttt)
    teacher = TeacherRows.from_probs(tlogp.exp(), targ, log_mass)
    fast, stats = ttt_forward(d, ids, aux, teacher, mask, ttt, denom, chunk=4, step_decay=0.6, loss=LossSpec.parse(kind, 2.0))
    g_fast = torch.autograd.grad(fast, list(d.parameters()))
    alphas = [[] for _ in range(ttt)]
    ref = sum(reference_loss(d, ids[b, :L], aux[b, :L], tlogp[b, :L], targ[b, :L], mask[b, :L], ttt, denom, kind=kind,
                             log_mass=log_mass[b, :L], decay=0.6, eta=2.0, alphas=alphas) for b, L in enumerate(lengths))
    g_ref = torch.autograd.grad(ref, list(d.parameters()))
    assert torch.allclose(fast, ref, rtol=1e-9, atol=1e-10), (fast, ref)
    for a, b in zip(g_fast, g_ref):
        assert torch.allclose(a, b, rtol=1e-7, atol=1e-10)
    for j in range(ttt):
        assert stats["alpha_sum"][j] == pytest.approx(sum(a * m for a, m in alphas[j]), rel=1e-9)
        assert stats["count"][j] == sum(m for _, m in alphas[j]) > 0


def test_padding_does_not_leak_into_valid_positions():
    d = tiny_draft(seed=3)
    ids, mask, aux, tlogp, targ = make_batch(d, [9, 9], seed=4)
    from eaglenest.train.ttt import denominators

    alone, _ = ttt_forward(d, ids[:1, :9], aux[:1, :9], TeacherRows.from_probs(tlogp[:1, :9].exp(), targ[:1, :9]), mask[:1, :9], 4,
                           denominators(mask[:1, :9], 4))
    # the same sample padded with garbage to length 15
    pad = lambda x, fill: torch.cat([x[:1], fill], 1)  # noqa: E731
    ids2 = pad(ids, torch.randint(0, 300, (1, 6)))
    aux2 = pad(aux, torch.randn(1, 6, 96, dtype=torch.float64) * 100)
    tl2 = pad(tlogp, torch.log_softmax(torch.randn(1, 6, 120, dtype=torch.float64), -1))
    ta2 = pad(targ, torch.randint(0, 300, (1, 6)))
    m2 = pad(mask, torch.zeros(1, 6, dtype=torch.long))
    padded, _ = ttt_forward(d, ids2, aux2, TeacherRows.from_probs(tl2.exp(), ta2), m2, 4, denominators(m2, 4))
    assert torch.allclose(alone, padded, rtol=1e-10)


def test_loss_mask_is_aligned_with_the_predicted_token():
    """mask marks x_5..x_7 as assistant tokens; step j at index t predicts x_{t+2+j} (its loss row) from
    the teacher at t+1+j; a step computes only the rows with a loss at it or a later step."""
    mask = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 0, 0]])
    p = plan_rows(mask, 3)
    assert p.loss0.tolist() == [3, 4, 5]  # step 0 predicts x_5..x_7
    s1, s2 = p.steps
    # rows 1..4, then repeats of the last up to a whole row bucket (their output goes nowhere)
    assert s1.idx[:5].tolist() == [1, 2, 3, 4, 4] and s1.rows == 64 and s1.idx[s1.loss].tolist() == [2, 3, 4]
    assert s2.idx[:4].tolist() == [1, 2, 3, 3] and s2.idx[s2.loss].tolist() == [1, 2, 3]
    assert s2.prev[:3].tolist() == [0, 1, 2]  # rows 1, 2, 3 among step 1's rows
    assert s1.slots.tolist() == [64, 0, 1, 2, 3] + [64] * 5  # each position's row, or "not computed"
    assert p.loss_teacher.tolist() == [4, 5, 6] * 3 and p.step_of_loss.tolist() == [0] * 3 + [1] * 3 + [2] * 3
    assert p.teacher_rows[:4].tolist() == [4, 5, 6, 6] and p.counts == [3, 3, 3]
    full = plan_rows(mask, 3, compact=False)
    assert [s.idx.unique().numel() for s in full.steps] == [10, 10] and full.loss_teacher.tolist() == p.loss_teacher.tolist()
    assert p.keep0 is None and full.keep0 is None  # one bucket holds all 10 rows: step 0 keeps every row's output
    # two buckets: step 0 keeps its output at the rows some step reads (1..5), the rest only give keys and values
    long = torch.zeros(1, 128, dtype=torch.long)
    long[0, 5:8] = 1
    p = plan_rows(long, 3)
    assert p.keep0[:6].tolist() == [1, 2, 3, 4, 5, 5] and p.keep0.numel() == 64
    assert p.keep0[p.loss0].tolist() == [3, 4, 5]  # the loss rows, as positions among the kept ones
    assert p.keep0[p.steps[0].prev[:4]].tolist() == [1, 2, 3, 4] == p.steps[0].idx[:4].tolist()  # step 1 continues row t
