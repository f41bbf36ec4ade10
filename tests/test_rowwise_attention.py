"""Row-wise attention (evaluate/rowwise/attention.py): each query row of a verification forward is the
single-query SDPA call over the keys its mask allows, so no row depends on another; plain decoding's
one-row forwards and prefills keep SDPA's own call; the install on a transformers model.

Every bit-for-bit comparison is between the same SDPA call on the same inputs, so it holds on any CPU;
that the right keys were chosen is checked against a masked multi-row SDPA with a tolerance."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers_eval import load_tiny

from eaglenest import EaglenestError
from eaglenest.evaluate.rowwise.attention import NAME, RowwiseAttention, install_rowwise_attention

pytestmark = pytest.mark.usefixtures("one_torch_thread")

H, HKV, D, CTX = 4, 2, 16, 9  # GQA heads, head size, cached keys before the verified rows
SCALE = D**-0.5


class _Module(torch.nn.Module):
    """What transformers' SDPA needs of an attention module."""

    is_causal = True
    num_key_value_groups = H // HKV


def _qkv(q_len: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    kv = CTX + q_len
    return (torch.randn(1, H, q_len, D, generator=g), torch.randn(1, HKV, kv, D, generator=g),
            torch.randn(1, HKV, kv, D, generator=g))


def _tree_mask(q_len: int) -> torch.Tensor:
    """[1, 1, q, CTX + q] bool: the context, then row 0 (the root), row i's parent (i - 1) // 2 and itself."""
    allowed = torch.zeros(q_len, CTX + q_len, dtype=torch.bool)
    allowed[:, :CTX] = True
    for i in range(q_len):
        j = i
        while True:
            allowed[i, CTX + j] = True
            if j == 0:
                break
            j = (j - 1) // 2
    return allowed[None, None]


@pytest.mark.parametrize("mask_kind", ["causal", "tree", "tree-additive"])
def test_each_row_is_its_own_single_query_call_over_its_keys(mask_kind):
    q_len = 5
    q, k, v = _qkv(q_len)
    allowed = _tree_mask(q_len) if mask_kind != "causal" else torch.ones(q_len, CTX + q_len, dtype=torch.bool).tril(CTX)[None, None]
    mask = {"causal": None, "tree": allowed,
            "tree-additive": torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))}[mask_kind]
    att = RowwiseAttention(max_rows=q_len)
    out, _ = att(_Module(), q, k, v, mask, scaling=SCALE)
    assert out.shape == (1, q_len, H, D)
    for i in range(q_len):
        keys = allowed[0, 0, i].nonzero().flatten()
        if int(keys[-1]) == keys.numel() - 1:  # a prefix of the cache: the slice plain decoding attends over
            ki, vi = k[:, :, : keys.numel()], v[:, :, : keys.numel()]
        else:
            ki, vi = k.index_select(2, keys), v.index_select(2, keys)
        one = F.scaled_dot_product_attention(q[:, :, i : i + 1], ki, vi, scale=SCALE, enable_gqa=True)
        assert torch.equal(out[:, i], one[:, :, 0]), i
    assert mask_kind == "causal" or any(int(r[-1]) != r.numel() - 1 for r in (allowed[0, 0, i].nonzero().flatten() for i in range(q_len)))
    # the keys chosen are the mask's: the multi-row masked call agrees (to rounding)
    full = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=SCALE, enable_gqa=True)
    torch.testing.assert_close(out, full.transpose(1, 2), atol=1e-5, rtol=1e-5)
    # and a row does not see the others: other query rows changed, its output bit for bit the same
    q2 = torch.randn_like(q)
    q2[:, :, 2] = q[:, :, 2]
    att.forget()
    assert torch.equal(att(_Module(), q2, k, v, mask, scaling=SCALE)[0][:, 2], out[:, 2])


def test_one_row_and_prefills_keep_sdpas_own_call():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    att = RowwiseAttention(max_rows=4)
    q, k, v = _qkv(1)
    out, _ = att(_Module(), q, k, v, None, scaling=SCALE)  # plain decoding: every key
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, scale=SCALE, enable_gqa=True).transpose(1, 2))
    for q_len, kv_len in ((6, CTX + 6), (6, 6), (3, 3)):  # more rows than verification has; prefills
        q, k, v = _qkv(q_len)
        k, v = k[:, :, -kv_len:], v[:, :, -kv_len:]
        out, _ = att(_Module(), q, k, v, None, scaling=SCALE)
        assert torch.equal(out, sdpa_attention_forward(_Module(), q, k, v, None, scaling=SCALE)[0]), (q_len, kv_len)


def test_install_shares_one_attention_per_model_and_forgets_the_mask_after_each_forward(tiny_llama_dir):
    m = load_tiny(tiny_llama_dir)
    att = install_rowwise_attention(m, 4)
    mods = [x for x in m.modules() if type(x).__name__.endswith("Attention")]
    assert m.config._attn_implementation == NAME and mods and all(x.eaglenest_rowwise is att for x in mods)
    assert install_rowwise_attention(m, 7) is att and att.max_rows == 7  # a second install: the same one, new rows
    q, k, v = _qkv(5)
    mask = _tree_mask(5)
    att(_Module(), q, k, v, mask, scaling=SCALE)
    assert att._mask is mask and len(att._rows) == 5  # the rows' keys, kept for the forward's other layers
    with torch.inference_mode():
        m(input_ids=torch.tensor([[1, 500, 600]]))
    assert att._mask is None and att._rows == []  # forgotten when the model's forward ends
    with pytest.raises(EaglenestError, match="no attention modules"):
        install_rowwise_attention(torch.nn.Sequential(torch.nn.Linear(2, 2)), 4)
