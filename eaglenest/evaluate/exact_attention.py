"""Row-wise attention: makes a multi-token verification forward bit-identical to token-by-token decoding.

Why: greedy speculative decoding is only *provably* equal to plain greedy decoding if the target
computes the same logits for a token whether it is fed alone (plain decode) or as row i of a
verification forward.  On CPU in bf16 the linear layers are row-invariant (oneDNN gives the same
bits for 1..32 rows; checked in tests), but SDPA over several query rows is not: its blocking
changes the summation order, the logits move by ~0.3, and near-ties flip the argmax (3 of 4
MT-bench answers diverged within 64 tokens).  bf16 is what we want on CPU (a 4-token forward
costs ~1.1x a 1-token one; ~1.7x in fp32), so instead of giving up exactness we compute each query
row of a decode/verify forward as its own single-query SDPA call over exactly the keys it may see
-- the same call, on the same key bytes, that plain decoding makes for that token.

Prefill (no cache yet, or more than MAX_ROWS rows) uses ordinary SDPA: the speculative and the
plain decoder prefill the same prompt identically anyway.  The cost is one small SDPA call per
verified row per layer (a few ms per round for a 30-layer model).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "eaglenest_rowwise"
MAX_ROWS = 32  # beyond this, bf16 GEMMs stop being row-invariant anyway (oneDNN switches kernels)

_last_mask: list = [None, None]  # (mask tensor, its per-row key selections): one mask per forward, shared by layers


def _row_keys(mask: torch.Tensor, q_len: int, kv_len: int) -> list:
    """Per query row: a key-prefix length (int) or an index tensor of allowed keys."""
    if _last_mask[0] is mask:
        return _last_mask[1]
    m = mask[0, 0] if mask.dim() == 4 else mask[0]
    allowed = m if m.dtype == torch.bool else (m == 0)
    allowed = allowed[-q_len:, :kv_len]
    rows = []
    for i in range(q_len):
        idx = allowed[i].nonzero().flatten()
        n = idx.numel()
        rows.append(n if n and int(idx[-1]) == n - 1 else idx)  # a prefix: slice, no copy
    _last_mask[0], _last_mask[1] = mask, rows
    return rows


def rowwise_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention interface: query [B, H, q, d], key/value [B, Hkv, L, d] -> ([B, q, H, d], None)."""
    B, _, q_len, _ = query.shape
    kv_len = key.shape[2]
    gqa = query.shape[1] != key.shape[1]
    if q_len == 1 and B == 1 and attention_mask is None:  # plain decoding: one row, every key (hot path)
        out = F.scaled_dot_product_attention(query, key, value, scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2), None
    if B != 1 or q_len > MAX_ROWS or kv_len == q_len:  # prefill / batches: ordinary SDPA
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if attention_mask is None:  # causal, aligned to the end (q_len == 1: every key)
        rows = [kv_len - q_len + i + 1 for i in range(q_len)]
    else:
        rows = _row_keys(attention_mask, q_len, kv_len)
    outs = []
    for i, sel in enumerate(rows):
        if isinstance(sel, int):
            k, v = key[:, :, :sel], value[:, :, :sel]
        else:
            k, v = key.index_select(2, sel), value.index_select(2, sel)
        outs.append(F.scaled_dot_product_attention(query[:, :, i : i + 1], k, v, scale=scaling, enable_gqa=gqa))
    out = torch.cat(outs, dim=2) if q_len > 1 else outs[0]
    return out.transpose(1, 2).contiguous(), None


def install(model) -> str:
    """Switch `model` to row-wise attention (registered once with transformers); returns the name."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(NAME, rowwise_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # build the usual causal masks for it
    model.set_attn_implementation(NAME)
    return NAME
