"""The EAGLE-3 draft head, top to bottom in one file.

A draft step at sequence index t takes two inputs:
  * the embedding of a token (frozen, the target's own `embed_tokens`), and
  * a hidden state: on the first step `fc([a_low ; a_mid ; a_high])`, the target's three aux
    states fused 3H -> H; on later steps the draft's own previous output (pre-norm).
It runs ONE Llama decoder layer whose attention projections read `[norm(embed) ; norm(hidden)]`
(2H wide), and predicts the next token over a reduced draft vocabulary:

    x   = cat(input_layernorm(embed), hidden_norm(hidden))          [.., 2H]
    h1  = hidden + o_proj(attention(q_proj(x), k_proj(x), v_proj(x)))
    h2  = h1 + mlp(post_attention_layernorm(h1))                    (fed back as next `hidden`)
    logits = lm_head(norm(h2))                                      [.., draft_vocab]

Draft id i means target id `i + d2t[i]`; `t2d[v]` says whether target id v is in the draft
vocabulary.  The parameter names are exactly those of the portable checkpoint
(`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`) that both SGLang and vLLM load;
`embed_tokens` is never exported (both engines use the target's).

Attention has two paths, one per use (the kernels live in kernels.py):
  * decoding, `Eagle3Draft.step(.., past_kv, mask)`: keys = cat(KV cache, new keys) under a
    boolean mask [.., Tq, Tk] (tree/chain ancestry; causal for a whole sequence);
  * training-time test, `Eagle3Draft.ttt_step(.., ctx_kv, diag_kv, kernel)`: step 0's keys
    causally, plus, at step j > 0, key t of every step 1..j at query t (the "diagonal": each step
    attends to the same positions of earlier steps).  `kernel` computes the causal part and
    returns its log-sum-exp so the diagonal keys merge exactly; None = the materializing reference.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from eaglenest.draft.kernels import eager_attention, merge_diagonal


@dataclass
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # target vocabulary (embeddings, t2d)
    draft_vocab_size: int  # lm_head rows
    target_hidden_size: int
    aux_layer_ids: list[int]  # capture-before convention (see eaglenest/capture/layers.py)
    target_num_layers: int
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    max_position_embeddings: int = 8192
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    target_architecture: str | None = None  # the target's class: the engines' layer-id rules depend on it (export/layer_ids.py)
    norm_before_residual: bool = False  # residual = hidden_norm(hidden): the speculators format's variant (vLLM only)
    # the draft kind: "eagle3" (this file) or "dflash" (draft/dflash.py: `aux_layer_ids` are its target layers, any
    # count); configs written before the field existed are EAGLE-3 drafts
    kind: str = "eagle3"
    num_hidden_layers: int = 1  # decoder layers (EAGLE-3: exactly one)
    block_size: int = 0  # DFlash: tokens per drafted block (anchor + block_size - 1 masks); 0 for EAGLE-3
    mask_token_id: int | None = None  # DFlash: the target token whose (frozen) embedding marks a masked slot

    @classmethod
    def from_target(cls, tcfg, draft_vocab_size: int, aux_layer_ids: list[int], shape: dict | None = None) -> "DraftConfig":
        """The target's hidden size, vocabulary and rope (exactly as the target has it); the layer's
        heads / head_dim / MLP width per target family, with `shape` overrides (draft/shape.py)."""
        from eaglenest.draft.shape import draft_shape
        from eaglenest.models.target import target_facts

        f = target_facts(tcfg)
        s = draft_shape(f, shape)
        get = tcfg.get if isinstance(tcfg, dict) else (lambda k, d=None: getattr(tcfg, k, d))
        return cls(
            hidden_size=f.hidden_size,
            intermediate_size=s.intermediate_size,
            num_attention_heads=s.num_attention_heads,
            num_key_value_heads=s.num_key_value_heads,
            head_dim=s.head_dim,
            vocab_size=f.vocab_size,
            draft_vocab_size=min(draft_vocab_size, f.vocab_size),
            target_hidden_size=f.hidden_size,
            aux_layer_ids=list(aux_layer_ids),
            target_num_layers=f.num_layers,
            rms_norm_eps=f.rms_norm_eps,
            hidden_act="silu",  # a Llama layer whatever the target: SGLang's LlamaMLP supports only silu
            max_position_embeddings=f.max_position_embeddings,
            rope_parameters=f.rope_parameters,
            bos_token_id=get("bos_token_id"),
            eos_token_id=get("eos_token_id"),
            target_architecture=f.architecture,
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DraftConfig":
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.promote_types(dtype, torch.float32))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """RoPE with the target's exact rope parameters (transformers computes inv_freq for every rope_type)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        lcfg = LlamaConfig(
            hidden_size=cfg.hidden_size,
            num_attention_heads=cfg.num_attention_heads,
            head_dim=cfg.head_dim,
            max_position_embeddings=cfg.max_position_embeddings,
            rope_parameters=dict(cfg.rope_parameters),
        )
        rope_type = cfg.rope_parameters.get("rope_type", "default")
        if rope_type == "default":
            base = float(cfg.rope_parameters.get("rope_theta", 10000.0))
            inv_freq = 1.0 / (base ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
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


class Attention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.n_head, self.n_kv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        in_dim = 2 * cfg.hidden_size  # [embed ; hidden]
        self.q_proj = nn.Linear(in_dim, self.n_head * self.hd, bias=False)
        self.k_proj = nn.Linear(in_dim, self.n_kv * self.hd, bias=False)
        self.v_proj = nn.Linear(in_dim, self.n_kv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.n_head * self.hd, cfg.hidden_size, bias=False)
        self.scale = 1.0 / math.sqrt(self.hd)

    def _qkv(self, x, cos, sin):
        B, T, _ = x.shape
        q = apply_rope(self.q_proj(x).view(B, T, self.n_head, self.hd).transpose(1, 2), cos, sin)
        k = apply_rope(self.k_proj(x).view(B, T, self.n_kv, self.hd).transpose(1, 2), cos, sin)
        v = self.v_proj(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        # grouped-query attention without copying K/V: queries as [B, kv, g, T, hd]
        return q.view(B, self.n_kv, self.n_head // self.n_kv, T, self.hd), k, v

    def _out(self, o):
        B, _, _, T, _ = o.shape
        return self.o_proj(o.reshape(B, self.n_head, T, self.hd).transpose(1, 2).reshape(B, T, self.n_head * self.hd))

    def forward(self, x, cos, sin, past_kv=None, mask=None):
        """Decoding: x [B, T, 2H]; keys = cat(past_kv, own); mask [B or 1, T, Tk] bool (True = may
        attend) or None (every key).  Returns (output, own (K, V))."""
        qg, k, v = self._qkv(x, cos, sin)
        keys = (k, v) if past_kv is None else (torch.cat([past_kv[0], k], dim=2), torch.cat([past_kv[1], v], dim=2))
        return self._out(eager_attention(qg, *keys, mask, (), self.scale)), (k, v)

    def forward_ttt(self, x, cos, sin, ctx_kv=None, diag_kv=(), kernel=None):
        """Training-time test: step 0 (ctx_kv None) attends causally to its own keys; step j > 0 to
        step 0's keys `ctx_kv` causally and, at query t, to key t of each of `diag_kv` and of its own."""
        qg, k, v = self._qkv(x, cos, sin)
        T = qg.shape[3]
        if ctx_kv is None:
            keys, diag = (k, v), list(diag_kv)
        else:
            keys, diag = ctx_kv, [*diag_kv, (k, v)]
        if kernel is None:
            causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()[None]
            o = eager_attention(qg, *keys, causal, diag, self.scale)
        else:
            o = merge_diagonal(*kernel(qg, *keys, self.scale), qg, diag, self.scale)
        return self._out(o), (k, v)


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = {"silu": F.silu, "gelu": F.gelu}[cfg.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    """The single decoder layer (named `midlayer` in the checkpoint)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # on the embedding
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # on the incoming hidden
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.norm_before_residual = cfg.norm_before_residual

    def forward(self, embeds, hidden, attend):
        """`attend(x) -> (attention output, own (K, V))`: the decoding or the training attention."""
        hn = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embeds), hn], dim=-1)
        a, new_kv = attend(x)
        h = (hn if self.norm_before_residual else hidden) + a  # residual: the un-normed hidden input (engines' default)
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, new_kv


class DraftVocab:
    """What every draft kind does with tokens (mixed into Eagle3Draft and dflash.DFlashDraft): the
    frozen target embeddings `embed_tokens`, `norm` + `lm_head` over the draft vocabulary, and the
    d2t/t2d mapping to target ids."""

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed_tokens)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits from a pre-norm hidden."""
        return self.lm_head(self.norm(hidden))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def exported_state_dict(self) -> dict[str, torch.Tensor]:
        """Exactly the portable checkpoint's tensors (no embed_tokens, no rotary buffers)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith(("embed_tokens", "rotary"))}

    def register_vocab(self, cfg: DraftConfig, embed_weight: torch.Tensor | None) -> None:
        """The buffers: the frozen target embeddings (not persistent, so optimizers and exports never
        see them) and the zeroed d2t/t2d mapping (set_vocab fills it)."""
        emb = embed_weight if embed_weight is not None else torch.zeros(cfg.vocab_size, cfg.hidden_size)
        self.register_buffer("embed_tokens", emb.detach().clone(), persistent=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))


class Eagle3Draft(DraftVocab, nn.Module):
    def __init__(self, cfg: DraftConfig, embed_weight: torch.Tensor | None = None):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.register_vocab(cfg, embed_weight)
        self.fc = nn.Linear(3 * cfg.target_hidden_size, H, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.rotary = Rotary(cfg)

    # --- pieces (embed, logits, to_target_ids, set_vocab: DraftVocab) -----------------------
    def fuse(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """[.., 3H_target] aux concat (low ; mid ; high) -> [.., H]."""
        return self.fc(aux_hidden_states.to(self.fc.weight.dtype))

    def step(self, input_ids, hidden, position_ids, past_kv=None, mask=None):
        """One decoding forward over the KV cache `past_kv` under `mask` (see Attention.forward).
        Returns (pre-norm hidden to feed back, this step's (K, V))."""
        cos, sin = self.rotary(position_ids)
        attn = self.midlayer.self_attn
        return self.midlayer(self.embed(input_ids).to(hidden.dtype), hidden, lambda x: attn(x, cos, sin, past_kv, mask))

    def ttt_step(self, input_ids, hidden, position_ids, ctx_kv=None, diag_kv=(), kernel=None):
        """One training-time-test step over whole sequences (see Attention.forward_ttt); `kernel`
        from eaglenest.draft.kernels.causal_kernel (None: the materializing reference)."""
        cos, sin = self.rotary(position_ids)
        attn = self.midlayer.self_attn
        return self.midlayer(self.embed(input_ids).to(hidden.dtype), hidden, lambda x: attn.forward_ttt(x, cos, sin, ctx_kv, diag_kv, kernel))

    # --- whole-sequence training forward (plain reference; the trainer has the TTT loop) ---
    def forward(self, input_ids, aux_hidden_states, position_ids=None):
        """Step 0 over a whole sequence with a causal mask: logits [B, T, draft_vocab]."""
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        h, _ = self.ttt_step(input_ids, self.fuse(aux_hidden_states), position_ids)
        return self.logits(h)
