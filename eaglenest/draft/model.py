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

The kinds both engines serve are flags of this one layout (`Eagle3Config`):
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
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from eaglenest.draft.config import DraftConfig  # the base every kind's config extends
from eaglenest.draft.kernels import eager_attention
# the pieces the kinds share live in layers.py (mla.py reads them from there, so it need not import this file)
from eaglenest.draft.layers import (  # noqa: F401 -- cache_length, rotate_half: re-exported
    MLP,
    RMSNorm,
    Rotary,
    apply_rope,
    cache_append,
    cache_length,
    kept_rows,
    rotate_half,
    ttt_attention,
)
from eaglenest.draft.mla import MLAAttention


@dataclass
class Eagle3Config(DraftConfig):
    """An EAGLE-3 head's config: what every kind has (draft/config.py) and its own options."""

    norm_before_residual: bool = False  # residual = hidden_norm(hidden): the speculators format's variant (vLLM only)
    fc_norm: bool = False  # EAGLE 3.1: an RMSNorm per aux state before fc (weights fc_norm.{0,1,2}.weight)
    norm_output: bool = False  # EAGLE 3.1: the next draft step reads norm(h2) instead of h2 (`feedback`)
    attention: str = "gqa"  # "gqa" (Llama attention) or "mla" (DeepSeek-V2 latent attention, draft/mla.py)
    q_lora_rank: int | None = None  # MLA sizes (None for gqa; q_lora_rank None = a plain q_proj)
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    kind: str = "eagle3"

    @classmethod
    def attention_fields(cls, shape) -> dict:
        return shape.attention_fields()  # gqa, or mla with its sizes

    @property
    def rope_dim(self) -> int:
        """Rotary width: the whole head (gqa), or MLA's rope part of q and k."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """Decoding cache per position: K and V of every KV head (gqa), or MLA's latent
        (kv_lora_rank compressed KV + the qk_rope_head_dim rope key, shared by all heads)."""
        if self.attention == "mla":
            return (self.kv_lora_rank + self.qk_rope_head_dim) * dtype_bytes
        return super().kv_bytes_per_token(dtype_bytes)


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
        """Training-time test (see `ttt_attention`).  Returns (output, only at the flat rows `keep`
        when given, own (K, V))."""
        o, kv = ttt_attention(*self._qkv(x, cos, sin), ctx_kv, diag_kv, kernel, self.scale, rows)
        return self._out(o, keep), kv


class MidLayer(nn.Module):
    """The single decoder layer (named `midlayer` in the checkpoint)."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # on the embedding
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # on the incoming hidden
        if cfg.attention == "mla":
            self.self_attn = MLAAttention(cfg)
        elif cfg.attention == "gqa":
            self.self_attn = Attention(cfg)
        else:
            raise ValueError(f"draft attention must be gqa or mla (got {cfg.attention!r})")
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.norm_before_residual = cfg.norm_before_residual

    def forward(self, embeds, hidden, attend, keep=None):
        """`attend(x) -> (attention output, own (K, V))`: the decoding or the training attention; with
        `keep` (flat row ids) the attention's output is those rows' only, and so is the layer's."""
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
    def __init__(self, cfg: Eagle3Config, embed_weight: torch.Tensor | None = None):
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
        """One training-time-test step (see `ttt_attention`): step 0 over whole sequences [B, T] (its output
        only at the flat rows `keep` when given: [1, N0]), a later step over its rows [1, N] (`rows`);
        `kernel` from eaglenest.draft.kernels.causal_kernel (None: the materializing reference)."""
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
