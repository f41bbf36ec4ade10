"""The MLA draft's attention: DeepSeek-V2 multi-latent attention over the EAGLE-3 input.

A sibling of `model.Attention` with the same two entry points (decoding with a cache, the
training-time test with its diagonal) and the same input x = [norm(embed) ; norm(hidden)] (2H):

    q      = q_b_proj(q_a_layernorm(q_a_proj(x)))   per head [nope ; rope]   (q_proj(x) if q_lora_rank is None)
    c, k_r = kv_a_proj_with_mqa(x)                  [kv_lora_rank], [qk_rope_head_dim]
    latent = [kv_a_layernorm(c) ; rope(k_r)]        ONE vector per position, shared by all heads
    k, v   = per head [kv_b_proj(c)_nope ; rope(k_r)], kv_b_proj(c)_v
    out    = o_proj(softmax(q.k * scale) v)

Decoding keeps only the latent per position (kv_lora_rank + qk_rope_head_dim values, as the
engines' MLA cache does) and expands it with kv_b_proj at attention time.  Training expands it
at once and runs the shared TTT attention (`model.ttt_attention`; the kernels take a value width
different from the query/key width).

Conventions read from the engines (vLLM 0.32 `deepseek_v2.py` DeepseekV2MLAAttention, SGLang
0.5.23 `deepseek_v2.py` DeepseekV2AttentionMLA, which `deepseek_eagle3.py` / `kimi_k25_eagle3.py`
build with a 2H input): the rope is the interleaved (GPT-J) rotation (`is_neox_style=False`);
the softmax scale is (nope + rope)^-0.5 times yarn_mscale(factor, mscale_all_dim)^2 for a YaRN
rope; the weight names are DeepSeek's (`q_a_proj`, `q_a_layernorm`, `q_b_proj`,
`kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`), which both loaders fuse or split
themselves (export/format.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from eaglenest.draft.kernels import eager_attention
from eaglenest.draft.model import DraftConfig, RMSNorm, cache_append, kept_rows, ttt_attention


def yarn_mscale(rope_parameters: dict) -> float:
    """The YaRN attention-temperature factor DeepSeek's MLA squares into its softmax scale."""
    if rope_parameters.get("rope_type", "default") == "default":
        return 1.0
    factor, m = float(rope_parameters.get("factor", 1.0)), float(rope_parameters.get("mscale_all_dim") or 0.0)
    return 0.1 * m * math.log(factor) + 1.0 if m and factor > 1 else 1.0


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J style rotation of pairs (0,1), (2,3), ... (DeepSeek's MLA rope; vLLM is_neox_style=False).
    x [B, heads, T, d]; cos/sin [B, T, d] in the rotate-half layout `model.Rotary` returns."""
    half = x.shape[-1] // 2
    c, s = cos[..., :half].unsqueeze(1).to(x.dtype), sin[..., :half].unsqueeze(1).to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)


class MLAAttention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        H, n = cfg.hidden_size, cfg.num_attention_heads
        self.n_head, self.r = n, cfg.kv_lora_rank
        self.nope, self.rope, self.vd = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        in_dim = 2 * H  # [embed ; hidden]
        qd = self.nope + self.rope
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(in_dim, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, n * qd, bias=False)
        else:
            self.q_proj = nn.Linear(in_dim, n * qd, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(in_dim, self.r + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.r, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.r, n * (self.nope + self.vd), bias=False)
        self.o_proj = nn.Linear(n * self.vd, H, bias=False)
        self.scale = qd**-0.5 * yarn_mscale(cfg.rope_parameters) ** 2

    def _project(self, x, cos, sin):
        """-> (q [B, heads, 1, T, nope+rope] as GQA-grouped queries, latent [B, 1, T, r+rope])."""
        B, T, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if hasattr(self, "q_a_proj") else self.q_proj(x)
        q = q.view(B, T, self.n_head, self.nope + self.rope).transpose(1, 2)
        q = torch.cat([q[..., : self.nope], apply_rope_interleaved(q[..., self.nope :], cos, sin)], dim=-1)
        c, k_rope = self.kv_a_proj_with_mqa(x).split([self.r, self.rope], dim=-1)
        latent = torch.cat([self.kv_a_layernorm(c)[:, None], apply_rope_interleaved(k_rope[:, None], cos, sin)], dim=-1)
        return q.unsqueeze(2), latent

    def _expand(self, latent):
        """Latent [B, 1, Tk, r+rope] -> per-head keys [B, heads, Tk, nope+rope], values [B, heads, Tk, v]."""
        B, _, Tk, _ = latent.shape
        c, k_rope = latent.split([self.r, self.rope], dim=-1)
        kv = self.kv_b_proj(c[:, 0]).view(B, Tk, self.n_head, self.nope + self.vd).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.vd], dim=-1)
        return torch.cat([k_nope, k_rope.expand(B, self.n_head, Tk, self.rope)], dim=-1), v

    def _out(self, o, keep=None):
        B, n, _, T, _ = o.shape
        return self.o_proj(kept_rows(o.reshape(B, n, T, self.vd).transpose(1, 2).reshape(B, T, n * self.vd), keep))

    def forward(self, x, cos, sin, past_kv=None, mask=None):
        """Decoding: the cache `past_kv` is (latent [B, 1, Tc, r+rope],); keys = cache + own, expanded
        here; mask as in `model.Attention.forward`.  Returns (output, own cache entries (latent,))."""
        q, latent = self._project(x, cos, sin)
        k, v = self._expand(cache_append(past_kv, (latent,))[0])
        return self._out(eager_attention(q, k, v, mask, (), self.scale)), (latent,)

    def forward_ttt(self, x, cos, sin, ctx_kv=None, diag_kv=(), kernel=None, rows=None, keep=None):
        """Training-time test (see `model.ttt_attention`) on the expanded keys and values."""
        q, latent = self._project(x, cos, sin)
        o, kv = ttt_attention(q, *self._expand(latent), ctx_kv, diag_kv, kernel, self.scale, rows)
        return self._out(o, keep), kv
