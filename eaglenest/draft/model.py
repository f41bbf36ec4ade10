"""The EAGLE-3 draft head, top to bottom in one file.

A draft step at sequence index t takes two inputs:
  * the embedding of a token (frozen, the target's own `embed_tokens`), and
  * a hidden state: on the first step `fc([a_low ; a_mid ; a_high])`, the target's three aux
    states fused 3H -> H; on later steps the draft's own previous output (pre-norm).
It runs ONE decoder layer whose attention projections read `[norm(embed) ; norm(hidden)]`
(2H wide), and predicts the next token over a reduced draft vocabulary:

    x   = cat(input_layernorm(embed), hidden_norm(hidden))          [.., 2H]
    h1  = hidden + o_proj(attention(x))
    h2  = h1 + mlp(post_attention_layernorm(h1))
    logits = lm_head(norm(h2))                                      [.., draft_vocab]
    next hidden = feedback(h2) = h2, or norm(h2) with `norm_output`

The kinds both engines serve are flags of this one layout (DraftConfig):
  * `attention`: "gqa" = Llama attention (q/k/v/o_proj; `LlamaForCausalLMEagle3`), "mla" =
    DeepSeek-V2 multi-latent attention (draft/mla.py; `Eagle3DeepseekV2ForCausalLM`), whose
    decoding cache is the small latent (compressed KV + rope key per position);
  * EAGLE 3.1: `fc_norm` = one RMSNorm per aux state before `fc` (in `fuse`), `norm_output` = the
    post-norm state is what the next draft step reads (`feedback`, used by training and decoding).

Draft id i means target id `i + d2t[i]`; `t2d[v]` says whether target id v is in the draft
vocabulary.  The parameter names are exactly those of the portable checkpoint
(`fc`, `fc_norm.*`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`) that both SGLang and vLLM load;
`embed_tokens` is never exported (both engines use the target's).

Attention (either kind) has two paths, one per use (the kernels live in kernels.py):
  * decoding, `Eagle3Draft.step(.., past_kv, mask)`: keys = the cache (the attention's own
    per-position entries: (K, V) or MLA's latent; `cache_append`) + the new ones, under a
    boolean mask [.., Tq, Tk] (tree/chain ancestry; causal for a whole sequence);
  * training-time test, `Eagle3Draft.ttt_step(.., ctx_kv, diag_kv, kernel, rows)`: step 0's keys
    causally, plus, at step j > 0, key t of every step 1..j at query t (the "diagonal": each step
    attends to the same positions of earlier steps).  Steps j > 0 run only the rows that still
    carry a loss (`rows`, train/compaction.py).  `kernel` computes the causal part and returns its
    log-sum-exp so the diagonal keys merge exactly; None = the materializing reference.
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
    fc_norm: bool = False  # EAGLE 3.1: an RMSNorm per aux state before fc (weights fc_norm.{0,1,2}.weight)
    norm_output: bool = False  # EAGLE 3.1: the next draft step reads norm(h2) instead of h2 (`feedback`)
    attention: str = "gqa"  # "gqa" (Llama attention) or "mla" (DeepSeek-V2 latent attention, draft/mla.py)
    q_lora_rank: int | None = None  # MLA sizes (None for gqa; q_lora_rank None = a plain q_proj)
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    # the draft kind: "eagle3" (this file) or "dflash" (draft/dflash.py: `aux_layer_ids` are its target layers, any
    # count); configs written before the field existed are EAGLE-3 drafts
    kind: str = "eagle3"
    num_hidden_layers: int = 1  # decoder layers (EAGLE-3: exactly one)
    block_size: int = 0  # DFlash: tokens per drafted block (anchor + block_size - 1 masks); 0 for EAGLE-3
    mask_token_id: int | None = None  # DFlash: the target token whose (frozen) embedding marks a masked slot

    @classmethod
    def from_target(cls, tcfg, draft_vocab_size: int, aux_layer_ids: list[int], shape: dict | None = None,
                    attention: str = "gqa", fc_norm: bool = False, norm_output: bool = False) -> "DraftConfig":
        """The target's hidden size, vocabulary and rope (exactly as the target has it); the layer's
        attention kind and sizes / MLP width per target family, with `shape` overrides (draft/shape.py)."""
        from eaglenest.draft.shape import draft_shape
        from eaglenest.models.target import target_facts

        f = target_facts(tcfg)
        s = draft_shape(f, shape, attention)
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
            fc_norm=bool(fc_norm),
            norm_output=bool(norm_output),
            **s.attention_fields(),
        )

    @property
    def rope_dim(self) -> int:
        """Rotary width: the whole head (gqa), or MLA's rope part of q and k."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """Decoding cache per position: K and V of every KV head (gqa), or MLA's latent
        (kv_lora_rank compressed KV + the qk_rope_head_dim rope key, shared by all heads)."""
        if self.attention == "mla":
            return (self.kv_lora_rank + self.qk_rope_head_dim) * dtype_bytes
        return 2 * self.num_key_value_heads * self.head_dim * dtype_bytes

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DraftConfig":
        """Unknown keys are dropped and missing optional ones default: run dirs and exports written
        before a field existed (fc_norm, norm_output, attention, ...) load as what they were."""
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


def _rms_normalize(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / rms(x) rounded to x's dtype, 1 / rms(x) per row in at least fp32): the Llama formula."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd).to(x.dtype), rstd


class _RMSNormFn(torch.autograd.Function):
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
        if ctx.needs_input_grad[1]:
            gw = (g * xhat.to(x.dtype)).reshape(-1, g.shape[-1]).sum(0).to(weight.dtype)
        if ctx.needs_input_grad[0]:
            gn = (g * weight).to(rstd.dtype)
            gx = (rstd * (gn - xhat * (gn * xhat).mean(-1, keepdim=True))).to(x.dtype)
        return gx, gw, None


def kept_rows(x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    return x if keep is None else x.reshape(1, -1, x.shape[-1]).index_select(1, keep)


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

    def _out(self, o, keep=None):
        B, _, _, T, _ = o.shape
        return self.o_proj(kept_rows(o.reshape(B, self.n_head, T, self.hd).transpose(1, 2).reshape(B, T, self.n_head * self.hd), keep))

    def forward(self, x, cos, sin, past_kv=None, mask=None):
        """Decoding: x [B, T, 2H]; keys = cache `past_kv` + own; mask [B or 1, T, Tk] bool (True =
        may attend) or None (every key).  Returns (output, own cache entries (K, V))."""
        qg, k, v = self._qkv(x, cos, sin)
        keys = cache_append(past_kv, (k, v))
        return self._out(eager_attention(qg, *keys, mask, (), self.scale)), (k, v)

    def forward_ttt(self, x, cos, sin, ctx_kv=None, diag_kv=(), kernel=None, rows=None, keep=None):
        o, kv = ttt_attention(*self._qkv(x, cos, sin), ctx_kv, diag_kv, kernel, self.scale, rows)
        return self._out(o, keep), kv


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


class MidLayer(nn.Module):
    """The single decoder layer (named `midlayer` in the checkpoint)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # on the embedding
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # on the incoming hidden
        if cfg.attention == "mla":
            from eaglenest.draft.mla import MLAAttention  # a sibling of Attention, same two entry points

            self.self_attn = MLAAttention(cfg)
        elif cfg.attention == "gqa":
            self.self_attn = Attention(cfg)
        else:
            raise ValueError(f"draft attention must be gqa or mla (got {cfg.attention!r})")
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.norm_before_residual = cfg.norm_before_residual

    def forward(self, embeds, hidden, attend, keep=None):
        """`attend(x) -> (attention output, own (K, V))`: the decoding or the training attention."""
        hn = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embeds), hn], dim=-1)
        a, new_kv = attend(x)
        h = kept_rows(hn if self.norm_before_residual else hidden, keep) + a  # residual: the un-normed hidden input (engines' default)
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
        # EAGLE 3.1: each aux state RMS-normed on its own before fc (None: EAGLE-3)
        self.fc_norm = nn.ModuleList([RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(3)]) if cfg.fc_norm else None
        self.fc = nn.Linear(3 * cfg.target_hidden_size, H, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.rotary = Rotary(cfg)

    # --- pieces (embed, logits, to_target_ids, set_vocab: DraftVocab) -----------------------
    def fuse(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """[.., 3H_target] aux concat (low ; mid ; high) -> [.., H]; with `fc_norm` each H-wide
        chunk is RMS-normed by its own norm first (both engines' combine step)."""
        x = aux_hidden_states.to(self.fc.weight.dtype)
        if self.fc_norm is not None:
            x = torch.cat([norm(c) for norm, c in zip(self.fc_norm, x.chunk(len(self.fc_norm), dim=-1))], dim=-1)
        return self.fc(x)

    def feedback(self, h: torch.Tensor) -> torch.Tensor:
        """The state the next draft step reads as `hidden`, from a step's output h2: h2 itself
        (EAGLE-3), or norm(h2) with `norm_output` (EAGLE 3.1), as both engines feed it back.  The
        one place this is decided: the TTT loop and the decoder both call it."""
        return self.norm(h) if self.cfg.norm_output else h

    def step(self, input_ids, hidden, position_ids, past_kv=None, mask=None):
        """One decoding forward over the cache `past_kv` (a tuple, see `cache_append`) under `mask`
        (see Attention.forward).  Returns (pre-norm output h2, this step's cache entries)."""
        cos, sin = self.rotary(position_ids)
        attn = self.midlayer.self_attn
        return self.midlayer(self.embed(input_ids).to(hidden.dtype), hidden, lambda x: attn(x, cos, sin, past_kv, mask))

    def ttt_step(self, input_ids, hidden, position_ids, ctx_kv=None, diag_kv=(), kernel=None, rows=None, keep=None):
        """One training-time-test step (see `ttt_attention`): step 0 over whole sequences [B, T], a later
        step over its rows [1, N] (`rows`); `kernel` from eaglenest.draft.kernels.causal_kernel (None:
        the materializing reference)."""
        cos, sin = self.rotary(position_ids)
        attn = self.midlayer.self_attn
        return self.midlayer(self.embed(input_ids).to(hidden.dtype), hidden,
                             lambda x: attn.forward_ttt(x, cos, sin, ctx_kv, diag_kv, kernel, rows, keep), keep)

    # --- whole-sequence training forward (plain reference; the trainer has the TTT loop) ---
    def forward(self, input_ids, aux_hidden_states, position_ids=None):
        """Step 0 over a whole sequence with a causal mask: logits [B, T, draft_vocab]."""
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        h, _ = self.ttt_step(input_ids, self.fuse(aux_hidden_states), position_ids)
        return self.logits(h)
