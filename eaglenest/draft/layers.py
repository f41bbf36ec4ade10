"""Pieces the draft kinds share (EAGLE-3's head and its MLA attention, DFlash): RMSNorm, the
target's rope, the SwiGLU MLP, the training-time-test attention and the decoding cache's tuple
convention.  Below draft/model.py and draft/mla.py so that neither imports the other for them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from eaglenest.draft.kernels import eager_attention, merge_diagonal

if TYPE_CHECKING:
    from eaglenest.draft.config import DraftConfig


def _rms_normalize(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / rms(x) rounded to x's dtype, 1 / rms(x) per row in at least fp32): the Llama formula."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd).to(x.dtype), rstd


class _RMSNormFn(torch.autograd.Function):
    """RMSNorm with its backward written out: it keeps the input and one scale per row, where autograd
    keeps the input's fp32 copy, its square and the normalized rows, and its backward takes half
    the passes (the training step's norms run at every TTT step; fp64 tests hold it to the formula)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        n, rstd = _rms_normalize(x, eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * n

    @staticmethod
    def backward(ctx, g):
        x, weight, rstd = ctx.saved_tensors
        xhat = x.to(rstd.dtype) * rstd
        gx = gw = None
        if ctx.needs_input_grad[1]:  # d(weight * n)/d weight, summed over rows, with n rounded as in the forward
            gw = (g * xhat.to(x.dtype)).reshape(-1, g.shape[-1]).sum(0).to(weight.dtype)
        if ctx.needs_input_grad[0]:  # d/dx of x * rstd(x): rstd * (gn - xhat * mean(gn * xhat))
            gn = (g * weight).to(rstd.dtype)
            gx = (rstd * (gn - xhat * (gn * xhat).mean(-1, keepdim=True))).to(x.dtype)
        return gx, gw, None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return _RMSNormFn.apply(x, self.weight, self.eps)
        return self.weight * _rms_normalize(x, self.eps)[0]


class Rotary(nn.Module):
    """RoPE with the target's exact rope parameters (transformers computes inv_freq for every
    rope_type), over `cfg.rope_dim` (MLA rotates only the rope part of q and k)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        dim = cfg.rope_dim
        lcfg = LlamaConfig(
            hidden_size=cfg.hidden_size,
            num_attention_heads=cfg.num_attention_heads,
            head_dim=dim,
            max_position_embeddings=cfg.max_position_embeddings,
            rope_parameters=dict(cfg.rope_parameters),
        )
        rope_type = cfg.rope_parameters.get("rope_type", "default")
        if rope_type == "default":
            base = float(cfg.rope_parameters.get("rope_theta", 10000.0))
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
            scale = 1.0
        else:
            inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](lcfg, None)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.attention_scaling = float(scale)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids.float()[..., None] * self.inv_freq  # [.., T, hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [B, heads, T, hd]; cos/sin [B, T, hd]
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    return x * cos + rotate_half(x) * sin


def ttt_attention(qg, k, v, ctx_kv, diag_kv, kernel, scale: float, rows=None):
    """Training-time-test attention, shared by the attention kinds, in the sequences' [B, T] layout:
    qg [B, kv, g, T, d_qk], k [B, kv, T, d_qk], v [B, kv, T, d_v] (d_v may differ: MLA).  Step 0
    (ctx_kv None) attends causally to its own keys; step j > 0 to step 0's keys `ctx_kv` causally and,
    at query t, to key t of each of `diag_kv` and of its own.  A compacted step (`rows`,
    train/compaction.py StepRows) comes as its rows ([1, .., N, d]), is placed at their positions for
    the attention and read back there.  Returns (output, own (K, V) in the [B, T] layout)."""
    if rows is not None:
        B = ctx_kv[0].shape[0]
        qg, k, v = rows.padded(qg, B), rows.padded(k, B), rows.padded(v, B)
    T = qg.shape[3]
    if ctx_kv is None:
        keys, diag = (k, v), list(diag_kv)
    else:
        keys, diag = ctx_kv, [*diag_kv, (k, v)]
    if kernel is None:
        causal = torch.ones(T, T, dtype=torch.bool, device=qg.device).tril()[None]
        out = eager_attention(qg, *keys, causal, diag, scale)
    else:
        out = merge_diagonal(*kernel(qg, *keys, scale), qg, diag, scale)
    return (out if rows is None else rows.unpadded(out)), (k, v)


def kept_rows(x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """x [B, T, D] -> [1, N, D], the rows at flat ids `keep` (b*T + t); None keeps x as it is.  A TTT step
    whose output is read at a few rows only (train/compaction.py keep0) runs its layer past the
    attention on those."""
    return x if keep is None else x.reshape(1, -1, x.shape[-1]).index_select(1, keep)


# --- the decoding cache: whatever the attention keeps per position, as tensors [B, heads, T, d] ---
def cache_append(cache: tuple | None, new: tuple) -> tuple:
    """A draft's decoding cache is a tuple of tensors with positions on dim 2 (gqa: (K, V);
    MLA: (latent,)), so the decoder appends and counts without knowing the attention kind."""
    return new if cache is None else tuple(torch.cat([a, b], dim=2) for a, b in zip(cache, new))


def cache_length(cache: tuple | None) -> int:
    return 0 if cache is None else cache[0].shape[2]


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = {"silu": F.silu, "gelu": F.gelu}[cfg.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
