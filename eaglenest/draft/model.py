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

Attention supports the two patterns eaglenest needs without materializing a big mask:
  * `past_kv` + `mask`: ordinary keys (a KV cache, or the whole sequence in training) with a
    boolean mask [.., Tq, Tk] (causal in training, tree/chain ancestry when decoding);
  * `diag_kv`: extra (K, V) pairs from earlier training-time-test steps, where query t sees
    only key t of each ("each step attends to the same positions of earlier steps");
    with `own_as_diag` a TTT step's own key joins them and `past_kv` (step 0's keys, causal
    mask) is the whole ordinary context.

`attn_impl` picks how the training pattern is computed (all compute the same function):
  * "eager": scores [B, kv, g, T, Tk] materialized (the reference; any mask; decoding);
  * "chunked": plain torch, flash-style: the causal part over query chunks with an online
    log-sum-exp and a hand-written backward that recomputes scores, so no more than
    [chunk, T] scores per kv head group ever exist (CPU and GPU; no compiler needed);
  * "flex": `torch.nn.attention.flex_attention` with a causal block mask returning the
    log-sum-exp (compiled on CUDA; eager flex on CPU is forward-only).
  The fast paths cover the training pattern only (ordinary keys = the queries' own positions,
  causal, no explicit mask): the causal part yields (out_c, lse_c) and the diagonal keys are
  merged exactly, out = (e^lse_c out_c + sum_i e^s_i v_i) / (e^lse_c + sum_i e^s_i).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


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


ATTN_IMPLS = ("eager", "chunked", "flex")


def default_attn_impl(device) -> str:
    """flex on CUDA (compiled flash-style kernel), the materializing reference elsewhere."""
    return "flex" if torch.device(device).type == "cuda" else "eager"


def _chunk_rows(n_kv: int, g: int, T: int, budget: int) -> int:
    """Query rows per chunk so that one chunk's scores [B=1, kv, g*rows, T] hold ~budget elements."""
    return max(16, min(T, budget // max(1, n_kv * g * T)))


class _ChunkedCausal(torch.autograd.Function):
    """Causal GQA attention returning (out, lse), flash-style in plain torch.

    q [B, kv, g, T, hd], k/v [B, kv, T, hd] -> out [B, kv, g, T, hd] (q's dtype), lse [B, kv, g, T]
    (fp32, natural log).  Forward and backward walk query chunks; a chunk's scores
    [B, kv, g*c, e] (e = chunk end) are the largest transient.  The backward takes a gradient
    for lse too (dS = P * (dP - D + dlse)), which the exact diagonal merge needs.  The g query
    heads of a kv head are stacked along rows, so K/V are never repeated.
    """

    @staticmethod
    def forward(ctx, q, k, v, scale: float, rows: int):
        B, n_kv, g, T, hd = q.shape
        acc = torch.promote_types(q.dtype, torch.float32)
        out = torch.empty_like(q)
        lse = torch.empty(B, n_kv, g, T, dtype=acc, device=q.device)
        for s in range(0, T, rows):
            e = min(T, s + rows)
            c = e - s
            qc = q[:, :, :, s:e].reshape(B, n_kv, g * c, hd)
            sc = torch.matmul(qc, k[:, :, :e].transpose(-1, -2)).to(acc).mul_(scale)  # [B, kv, g*c, e]
            sc5 = sc.view(B, n_kv, g, c, e)
            tri = torch.ones(c, c, dtype=torch.bool, device=q.device).triu_(1)  # key > query inside the block
            sc5[..., s:e].masked_fill_(tri, float("-inf"))
            l = torch.logsumexp(sc, dim=-1, keepdim=True)
            p = sc.sub_(l).exp_().to(v.dtype)
            out[:, :, :, s:e] = torch.matmul(p, v[:, :, :e]).view(B, n_kv, g, c, hd)
            lse[:, :, :, s:e] = l.view(B, n_kv, g, c)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.rows = scale, rows
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        scale, rows = ctx.scale, ctx.rows
        B, n_kv, g, T, hd = q.shape
        acc = lse.dtype
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=q.device)
        dv = torch.zeros(v.shape, dtype=acc, device=q.device)
        if dout is None:
            dout = torch.zeros_like(out)
        for s in range(0, T, rows):
            e = min(T, s + rows)
            c = e - s
            qc = q[:, :, :, s:e].reshape(B, n_kv, g * c, hd)
            doc = dout[:, :, :, s:e].reshape(B, n_kv, g * c, hd)
            D = (doc.to(acc) * out[:, :, :, s:e].reshape(B, n_kv, g * c, hd).to(acc)).sum(-1, keepdim=True)
            if dlse is not None:
                D = D - dlse[:, :, :, s:e].reshape(B, n_kv, g * c, 1).to(acc)
            sc = torch.matmul(qc, k[:, :, :e].transpose(-1, -2)).to(acc).mul_(scale)
            sc5 = sc.view(B, n_kv, g, c, e)
            tri = torch.ones(c, c, dtype=torch.bool, device=q.device).triu_(1)
            sc5[..., s:e].masked_fill_(tri, float("-inf"))
            p = sc.sub_(lse[:, :, :, s:e].reshape(B, n_kv, g * c, 1)).exp_()  # [B, kv, g*c, e]
            dv[:, :, :e] += torch.matmul(p.to(v.dtype).transpose(-1, -2), doc).to(acc)
            dp = torch.matmul(doc, v[:, :, :e].transpose(-1, -2)).to(acc)
            ds = p.mul_(dp.sub_(D)).mul_(scale).to(q.dtype)  # dS * scale
            dq[:, :, :, s:e] = torch.matmul(ds, k[:, :, :e]).view(B, n_kv, g, c, hd).to(acc)
            dk[:, :, :e] += torch.matmul(ds.transpose(-1, -2), qc).to(acc)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


_FLEX_MASKS: dict = {}
_FLEX_FN: dict = {}


def _causal_mask_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def causal_block_mask(T: int, device, block: int = 128):
    """The causal BlockMask built from its block structure directly (O((T/block)^2) ints):
    create_block_mask would evaluate the mask over all T*T pairs (17 G at 131072) unless compiled."""
    from torch.nn.attention.flex_attention import BlockMask

    n = (T + block - 1) // block
    ar = torch.arange(n, device=device, dtype=torch.int32)
    kv_num = torch.ones(1, 1, n, dtype=torch.int32, device=device)  # the diagonal block: partial
    full_idx = ar.view(1, 1, 1, n).expand(1, 1, n, n).contiguous()  # row r: blocks 0..r-1 are full
    full_num = ar.view(1, 1, n).clone()
    kv_idx = full_idx.clone()
    kv_idx[..., 0] = ar  # row r: block r (the diagonal) is partial
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=_causal_mask_mod, seq_lengths=(T, T))


def _flex_causal(q, k, v, scale: float):
    """flex_attention over q [B, H, T, hd], k/v [B, kv, T, hd] with a causal block mask -> (out, lse)."""
    from torch.nn.attention import flex_attention as fa

    T, dev = q.shape[2], q.device
    key = (T, str(dev))
    bm = _FLEX_MASKS.get(key)
    if bm is None:
        _FLEX_MASKS.clear()  # one length at a time
        bm = _FLEX_MASKS[key] = causal_block_mask(T, dev)
    fn = fa.flex_attention
    if dev.type == "cuda":  # eager flex materializes the scores: compile it (once per process)
        fn = _FLEX_FN.get("cuda")
        if fn is None:
            fn = _FLEX_FN["cuda"] = torch.compile(fa.flex_attention, dynamic=False)
    kw = dict(block_mask=bm, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    if hasattr(fa, "AuxRequest"):
        out, aux = fn(q, k, v, return_aux=fa.AuxRequest(lse=True), **kw)
        return out, aux.lse
    return fn(q, k, v, return_lse=True, **kw)


def causal_attention_lse(q, k, v, scale: float, impl: str, chunk_elems: int | None = None):
    """q [B, kv, g, T, hd], k/v [B, kv, T, hd] -> (out [B, kv, g, T, hd], lse [B, kv, g, T] fp32)."""
    B, n_kv, g, T, hd = q.shape
    if impl == "chunked":
        budget = chunk_elems or (1 << 28 if q.is_cuda else 1 << 22)
        return _ChunkedCausal.apply(q, k, v, scale, _chunk_rows(n_kv, g, T, budget))
    if impl == "flex":
        out, lse = _flex_causal(q.reshape(B, n_kv * g, T, hd), k, v, scale)
        return out.view(B, n_kv, g, T, hd), lse.view(B, n_kv, g, T).float()
    raise ValueError(f"attn_impl must be one of {ATTN_IMPLS} (got {impl!r})")


class Attention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.n_head, self.n_kv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        in_dim = 2 * cfg.hidden_size  # [embed ; hidden]
        self.q_proj = nn.Linear(in_dim, self.n_head * self.hd, bias=False)
        self.k_proj = nn.Linear(in_dim, self.n_kv * self.hd, bias=False)
        self.v_proj = nn.Linear(in_dim, self.n_kv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.n_head * self.hd, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, past_kv=None, mask=None, diag_kv=(), own_as_diag=False, attn_impl="eager"):
        """x [B, T, 2H]; mask [B or 1, T, Tk] bool (True = may attend) over the ordinary keys:
        cat(past, new), or past alone when own_as_diag (then the new keys are diagonal).
        attn_impl != "eager": the training pattern only; `mask` is ignored and the ordinary keys
        (own keys, or past_kv with own_as_diag) are attended causally."""
        B, T, _ = x.shape
        g = self.n_head // self.n_kv
        q = apply_rope(self.q_proj(x).view(B, T, self.n_head, self.hd).transpose(1, 2), cos, sin)
        k = apply_rope(self.k_proj(x).view(B, T, self.n_kv, self.hd).transpose(1, 2), cos, sin)
        v = self.v_proj(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        new_kv = (k, v)
        if own_as_diag:
            diag_kv = [*diag_kv, new_kv]
            k, v = past_kv
        elif past_kv is not None:
            if attn_impl != "eager":
                raise ValueError(f"attn_impl={attn_impl!r} covers the training pattern only (no KV cache): use eager")
            k = torch.cat([past_kv[0], k], dim=2)
            v = torch.cat([past_kv[1], v], dim=2)
        # grouped-query attention without copying K/V: queries as [B, kv, g, T, hd]
        qg = q.view(B, self.n_kv, g, T, self.hd)
        scale = 1.0 / math.sqrt(self.hd)
        acc = torch.promote_types(q.dtype, torch.float32)  # softmax in >= fp32 (bf16 under autocast)
        if attn_impl != "eager":
            if k.shape[2] != T:
                raise ValueError(f"attn_impl={attn_impl!r}: ordinary keys must be the queries' own positions ({k.shape[2]} != {T})")
            out = self._fast(qg, k, v, diag_kv, scale, acc, attn_impl)
        else:
            out = self._eager(qg, k, v, mask, diag_kv, scale, acc)
        out = out.reshape(B, self.n_head, T, self.hd).transpose(1, 2).reshape(B, T, self.n_head * self.hd)
        return self.o_proj(out), new_kv

    @staticmethod
    def _eager(qg, k, v, mask, diag_kv, scale, acc):
        s = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2)).to(acc) * scale  # [B, kv, g, T, Tk]
        if mask is not None:
            s = s.masked_fill(~mask[:, None, None], float("-inf"))
        # earlier TTT steps: query t sees key t of each ([B, kv, g, T, 1] scores)
        ds = [(qg * dk.unsqueeze(2)).sum(-1, keepdim=True).to(acc) * scale for dk, _ in diag_kv]
        p = torch.softmax(torch.cat([s, *ds], dim=-1), dim=-1).to(v.dtype)
        Tk = k.shape[2]
        out = torch.matmul(p[..., :Tk], v.unsqueeze(2))
        for i, (_, dv) in enumerate(diag_kv):
            out = out + p[..., Tk + i : Tk + i + 1] * dv.unsqueeze(2)
        return out

    @staticmethod
    def _fast(qg, k, v, diag_kv, scale, acc, impl):
        out_c, lse_c = causal_attention_lse(qg, k, v, scale, impl)
        if not diag_kv:
            return out_c
        # exact merge of the diagonal keys: a softmax over [lse_c, s_1 .. s_j] weights out_c and v_i
        ds = [(qg * dk.unsqueeze(2)).sum(-1).to(acc) * scale for dk, _ in diag_kv]  # [B, kv, g, T] each
        w = torch.softmax(torch.stack([lse_c.to(acc), *ds], dim=-1), dim=-1)  # [B, kv, g, T, 1 + j]
        out = w[..., 0:1] * out_c.to(acc)
        for i, (_, dv) in enumerate(diag_kv):
            out = out + w[..., i + 1 : i + 2] * dv.unsqueeze(2).to(acc)
        return out.to(v.dtype)


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

    def forward(self, embeds, hidden, cos, sin, past_kv=None, mask=None, diag_kv=(), own_as_diag=False, attn_impl="eager"):
        hn = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embeds), hn], dim=-1)
        a, new_kv = self.self_attn(x, cos, sin, past_kv, mask, diag_kv, own_as_diag, attn_impl)
        h = (hn if self.norm_before_residual else hidden) + a  # residual: the un-normed hidden input (engines' default)
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, new_kv


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: DraftConfig, embed_weight: torch.Tensor | None = None):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        # frozen target embeddings; a buffer, so optimizers and exports never see it
        emb = embed_weight if embed_weight is not None else torch.zeros(cfg.vocab_size, H)
        self.register_buffer("embed_tokens", emb.detach().clone(), persistent=False)
        self.fc = nn.Linear(3 * cfg.target_hidden_size, H, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.rotary = Rotary(cfg)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))

    # --- pieces ---------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed_tokens)

    def fuse(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """[.., 3H_target] aux concat (low ; mid ; high) -> [.., H]."""
        return self.fc(aux_hidden_states.to(self.fc.weight.dtype))

    def step(self, input_ids, hidden, position_ids, past_kv=None, mask=None, diag_kv=(), own_as_diag=False, attn_impl="eager"):
        """One draft forward. Returns (pre-norm hidden to feed back, this step's (K, V)).
        attn_impl "chunked"/"flex": the training pattern without a [T, Tk] mask or scores (see top)."""
        cos, sin = self.rotary(position_ids)
        embeds = self.embed(input_ids).to(hidden.dtype)
        return self.midlayer(embeds, hidden, cos, sin, past_kv, mask, diag_kv, own_as_diag, attn_impl)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits from a pre-norm hidden."""
        return self.lm_head(self.norm(hidden))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    # --- whole-sequence training forward (plain reference; the trainer has the TTT loop) ---
    def forward(self, input_ids, aux_hidden_states, position_ids=None):
        """Step 0 over a whole sequence with a causal mask: logits [B, T, draft_vocab]."""
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=input_ids.device).tril()[None]
        h, _ = self.step(input_ids, self.fuse(aux_hidden_states), position_ids, mask=causal)
        return self.logits(h)

    def exported_state_dict(self) -> dict[str, torch.Tensor]:
        """Exactly the portable checkpoint's tensors (no embed_tokens, no rotary buffers)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith(("embed_tokens", "rotary"))}
