"""The DFlash draft (arXiv 2602.06036): a block-diffusion drafter, a sibling of the EAGLE-3 head.

One forward drafts a whole block.  The target's states at several layers (`cfg.aux_layer_ids`,
capture-before, any count) are fused and injected as extra keys/values into every draft layer:

    ctx      = hidden_norm(fc([a_1 ; ... ; a_n]))                       [.., T, H]  (one per target position)
    layer i:   context keys/values  K_i = k_norm(k_proj_i(ctx)) (roped at the context positions), V_i = v_proj_i(ctx)
    block    = [anchor token, MASK x (block_size - 1)] at positions p .. p + block_size - 1
    h        = embed(block);  per layer:  x = input_layernorm(h);
               h += o_proj(attention(q_norm(q_proj(x)), keys = [K_i of context < p ; k_norm(k_proj(x))],
                                     values = [V_i ; v_proj(x)]))    (non-causal inside the block)
               h += mlp(post_attention_layernorm(h))
    logits   = lm_head(norm(h))   at block slot k >= 1 predict the token at position p + k

The anchor is the newest committed token (the one the target has not processed yet); the context
is every earlier position.  Qwen3-style layers (per-head q/k RMSNorm, no bias) with the target's
rope; embeddings frozen and shared with the target (the MASK slot is the target's embedding of
`cfg.mask_token_id`); lm_head over a reduced draft vocabulary (d2t/t2d as in EAGLE-3, which vLLM
0.32's DFlash loader maps too).  Parameter names are exactly those of the checkpoint vLLM 0.32
loads (`fc`, `hidden_norm`, `layers.N.*`, `norm`, `lm_head`, `d2t`); see kinds/dflash.py.

The pieces shared with the EAGLE-3 head come from draft/layers.py (RMSNorm, Rotary, apply_rope,
MLP) and draft/kernels.py (`block_attention`, used by training and decoding alike).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from eaglenest.draft.kernels import block_attention
from eaglenest.draft.layers import MLP, Rotary, RMSNorm, apply_rope
from eaglenest.draft.config import DraftConfig
from eaglenest.draft.model import DraftVocab


@dataclass
class DFlashConfig(DraftConfig):
    """A DFlash draft's config: what every kind has (draft/config.py; `aux_layer_ids` are its
    target layers, any count; `num_hidden_layers` its layers) and its block."""

    block_size: int = 16  # tokens per drafted block (anchor + block_size - 1 masks)
    mask_token_id: int | None = None  # the target token whose (frozen) embedding marks a masked slot
    kind: str = "dflash"


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.n_head, self.n_kv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        H = cfg.hidden_size
        self.q_proj = nn.Linear(H, self.n_head * self.hd, bias=False)
        self.k_proj = nn.Linear(H, self.n_kv * self.hd, bias=False)
        self.v_proj = nn.Linear(H, self.n_kv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.n_head * self.hd, H, bias=False)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.scale = 1.0 / math.sqrt(self.hd)

    def kv(self, x, cos, sin):
        """x [B, T, H] -> roped, k-normed keys and values [B, kv, T, hd] (context or block)."""
        B, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, T, self.n_kv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, ctx_kv, ctx_visible):
        """x [B, N, S, H] (N blocks of S slots), cos/sin [B, N*S, hd], ctx_kv (K, V) [B, kv, T, hd],
        ctx_visible [B, N]: the context keys each block sees (a prefix)."""
        B, N, S, _ = x.shape
        flat = x.reshape(B, N * S, -1)
        q = self.q_norm(self.q_proj(flat).view(B, N * S, self.n_head, self.hd)).transpose(1, 2)
        q = apply_rope(q, cos, sin)  # [B, heads, N*S, hd]
        k, v = self.kv(flat, cos, sin)
        g = self.n_head // self.n_kv
        qg = q.reshape(B, self.n_kv, g, N, S, self.hd)  # grouped-query heads, no K/V copies
        o = block_attention(qg, *ctx_kv, k.view(B, self.n_kv, N, S, self.hd), v.view(B, self.n_kv, N, S, self.hd),
                            ctx_visible, self.scale)
        o = o.reshape(B, self.n_head, N * S, self.hd).transpose(1, 2).reshape(B, N, S, self.n_head * self.hd)
        return self.o_proj(o)


class DFlashLayer(nn.Module):
    """One Qwen3-style decoder layer (`layers.N` in the checkpoint)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h, cos, sin, ctx_kv, ctx_visible):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, ctx_kv, ctx_visible)
        return h + self.mlp(self.post_attention_layernorm(h))


def sharpen_attention(model: "DFlashDraft", gain: float) -> None:
    """Start every layer's q/k RMSNorm gains at `gain` (a fresh RMSNorm's are 1): initial attention
    logits q.k/sqrt(d) spread gain^2 times wider.  A mask slot learns what to read (its anchor, the
    newest context) through q and k alone, and its accuracy stays near 0 until it has; over-fitting
    eight answers on a fixed batch (lr 2e-3, issue 42), slot 1 first reached 0.8 after 91 steps with
    gain 1 and after 57-67 with gains 2-4.  The gains train on and are exported (vLLM reads them)."""
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.q_norm.weight.fill_(gain)
            layer.self_attn.k_norm.weight.fill_(gain)


class DFlashDraft(DraftVocab, nn.Module):
    def __init__(self, cfg: DFlashConfig, embed_weight: torch.Tensor | None = None):
        super().__init__()  # the config is checked by its kind (kinds/dflash.py check_dflash_config)
        self.cfg = cfg
        H = cfg.hidden_size
        self.register_vocab(cfg, embed_weight)  # the target's embeddings (frozen), d2t/t2d
        self.fc = nn.Linear(len(cfg.aux_layer_ids) * cfg.target_hidden_size, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.rotary = Rotary(cfg)

    # --- pieces (embed, logits, to_target_ids, set_vocab, exported_state_dict: DraftVocab) --
    def fuse(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """[.., n*H_target] target states -> the context states hidden_norm(fc(.)) [.., H]."""
        return self.hidden_norm(self.fc(aux_hidden_states.to(self.fc.weight.dtype)))

    def context_kv(self, ctx: torch.Tensor, position_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Context states [B, T, H] at `position_ids` [B, T] -> every layer's (K, V) [B, kv, T, hd].
        The same context enters every layer (no input_layernorm: vLLM's precompute_and_store_context_kv)."""
        cos, sin = self.rotary(position_ids)
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def blocks(self, block_ids, position_ids, ctx_kv, ctx_visible) -> torch.Tensor:
        """block_ids / position_ids [B, N, S] (slot 0 the anchor, then masks), ctx_kv from `context_kv`,
        ctx_visible [B, N] -> pre-norm hidden states [B, N, S, H]."""
        B, N, S = block_ids.shape
        cos, sin = self.rotary(position_ids.reshape(B, N * S))
        h = self.embed(block_ids).to(self.fc.weight.dtype)
        for layer, kv in zip(self.layers, ctx_kv):
            h = layer(h, cos, sin, kv, ctx_visible)
        return h

    def block_input(self, anchors: torch.Tensor) -> torch.Tensor:
        """Anchor tokens [..] -> block ids [.., block_size]: the anchor, then mask tokens."""
        ids = torch.full((*anchors.shape, self.cfg.block_size), int(self.cfg.mask_token_id), dtype=torch.long, device=anchors.device)
        ids[..., 0] = anchors
        return ids

    # --- one block over a whole context (the plain reference; training has objective.py) ---
    def forward(self, aux_hidden_states, anchor_ids, anchor_positions):
        """aux [B, T, n*H]; anchors [B, N] with positions [B, N] (block n sees the context before its
        anchor) -> logits [B, N, block_size, draft_vocab]."""
        B, T, _ = aux_hidden_states.shape
        pos = torch.arange(T, device=aux_hidden_states.device).expand(B, T)
        kv = self.context_kv(self.fuse(aux_hidden_states), pos)
        S = self.cfg.block_size
        bpos = anchor_positions[..., None] + torch.arange(S, device=anchor_positions.device)
        return self.logits(self.blocks(self.block_input(anchor_ids), bpos, kv, anchor_positions))
