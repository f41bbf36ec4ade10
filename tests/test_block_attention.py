"""DFlash's block attention holds at most a budget of context scores at a time (groups of blocks,
checkpointed under autograd) and computes the same values and gradients as all blocks at once."""

import pytest
import torch

from eaglenest.draft.kernels import block_attention

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_bounded_block_attention_equals_all_blocks_at_once():
    g = torch.Generator().manual_seed(0)
    B, kv, gq, N, S, hd, T = 2, 2, 3, 7, 4, 8, 40
    qg = torch.randn(B, kv, gq, N, S, hd, generator=g, dtype=torch.float64, requires_grad=True)
    ctx_k, ctx_v = (torch.randn(B, kv, T, hd, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    blk_k, blk_v = (torch.randn(B, kv, N, S, hd, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    vis = torch.randint(1, T, (B, N), generator=g)
    inputs = (qg, ctx_k, ctx_v, blk_k, blk_v)
    per_block = B * kv * gq * S * T
    outs = {}
    for budget in (None, 2 * per_block):  # all 7 blocks at once, then groups of 2 (the last of 1)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            o = block_attention(qg, ctx_k, ctx_v, blk_k, blk_v, vis, 0.3, budget=budget)
        outs[budget] = (o, torch.autograd.grad((o * o.detach().sin()).sum(), inputs), max(saved))
    (o1, g1, big), (o2, g2, small) = outs[None], outs[2 * per_block]
    torch.testing.assert_close(o2, o1, rtol=1e-12, atol=1e-14)
    for a, b in zip(g2, g1):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-13)
    assert big >= N * per_block and small < 2 * per_block + B * kv * gq * 2 * S * S  # no [.., N*S, T] score tensor kept
