"""Row-wise attention: each query row of a verification forward is its own single-query SDPA call
over exactly the keys it may see (a prefix of the cache for a chain, the ancestors' keys under a
tree's 4-D mask) -- the call plain decoding makes for that token, so the row's output cannot depend on
the other rows, as a multi-row SDPA call's may (verification.py: what was seen).

Forwards of one row with no mask (plain decoding) take that single-query call directly; prefills
(as many queries as keys), batches and forwards of more than max_rows rows go to transformers' own
SDPA.  It is registered with transformers under NAME and selected with set_attn_implementation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "eaglenest_rowwise"  # the attention implementation name registered with transformers


class RowwiseAttention:
    """The attention of one model.  The per-row key selections of a mask are computed once per
    forward (every layer gets the same mask object) and forgotten after it (`forget`)."""

    def __init__(self, max_rows: int):
        self.max_rows = max_rows
        self._mask = None
        self._rows: list = []

    def forget(self, *_ignored) -> None:
        self._mask, self._rows = None, []

    def _row_keys(self, mask: torch.Tensor, q_len: int, kv_len: int) -> list:
        """Per query row: a key-prefix length (int) or an index tensor of allowed keys."""
        if self._mask is mask:
            return self._rows
        m = mask[0, 0] if mask.dim() == 4 else mask[0]
        allowed = m if m.dtype == torch.bool else (m == 0)
        allowed = allowed[-q_len:, :kv_len]
        rows = []
        for i in range(q_len):
            idx = allowed[i].nonzero().flatten()
            n = idx.numel()
            rows.append(n if n and int(idx[-1]) == n - 1 else idx)  # a prefix: slice, no copy
        self._mask, self._rows = mask, rows
        return rows

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        """query [B, H, q, d], key/value [B, Hkv, L, d] -> ([B, q, H, d], None)."""
        B, _, q_len, _ = query.shape
        kv_len = key.shape[2]
        gqa = query.shape[1] != key.shape[1]
        if q_len == 1 and B == 1 and attention_mask is None:  # plain decoding: one row, every key (hot path)
            out = F.scaled_dot_product_attention(query, key, value, scale=scaling, enable_gqa=gqa)
            return out.transpose(1, 2), None
        if B != 1 or q_len > self.max_rows or kv_len == q_len:  # prefill / batches: ordinary SDPA
            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        if attention_mask is None:  # causal, aligned to the end
            rows = [kv_len - q_len + i + 1 for i in range(q_len)]
        else:
            rows = self._row_keys(attention_mask, q_len, kv_len)
        outs = []
        for i, sel in enumerate(rows):
            if isinstance(sel, int):
                k, v = key[:, :, :sel], value[:, :, :sel]
            else:
                k, v = key.index_select(2, sel), value.index_select(2, sel)
            outs.append(F.scaled_dot_product_attention(query[:, :, i : i + 1], k, v, scale=scaling, enable_gqa=gqa))
        out = torch.cat(outs, dim=2) if q_len > 1 else outs[0]
        return out.transpose(1, 2).contiguous(), None


def _dispatch(module, *args, **kwargs):
    """The function registered with transformers (its registry is global): the work is done by the
    RowwiseAttention that `install_rowwise_attention` attached to this model's attention modules."""
    return module.eaglenest_rowwise(module, *args, **kwargs)


def _attention_modules(model) -> list:
    """The modules that call transformers' attention interface (LlamaAttention, Qwen2Attention, ...)."""
    return [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "config")]


def install_rowwise_attention(model, max_rows: int) -> RowwiseAttention:
    """Switch `model` to row-wise attention for forwards of up to `max_rows` query rows."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    mods = _attention_modules(model)
    if not mods:
        from eaglenest import EaglenestError

        raise EaglenestError(f"{type(model).__name__}: no attention modules (*Attention) found for row-wise attention")
    AttentionInterface.register(NAME, _dispatch)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # the usual causal masks
    att = getattr(mods[0], "eaglenest_rowwise", None)
    if att is None:  # first install on this model
        att = RowwiseAttention(max_rows)
        for m in mods:
            m.eaglenest_rowwise = att
        model.register_forward_hook(att.forget)  # the memo lives for one forward only
    att.max_rows = max_rows
    model.set_attn_implementation(NAME)
    return att
