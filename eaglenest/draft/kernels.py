"""Attention kernels of the draft, apart from the model that reads top to bottom (model.py).

Shapes: grouped-query heads are kept as [B, kv, g, T, hd] queries against [B, kv, Tk, hd] keys,
so K/V are never repeated per query head.  Values may be narrower or wider than queries and keys
([B, kv, Tk, vd]; MLA drafts: q/k nope + rope, v v_head_dim): every kernel's output is [.., vd].

  * `eager_attention`: scores materialized; any boolean mask; optional "diagonal" keys (query t
    sees key t of each): the reference, and the decoding path (KV cache + tree mask).
  * causal kernels for training, each returning (out, lse) so that the diagonal keys of the
    training-time-test steps are merged exactly afterwards (`merge_diagonal`):
      - `ChunkedCausal`: flash-style in plain torch (query chunks, online log-sum-exp, a
        hand-written backward that recomputes scores): no more than [chunk, T] scores exist;
      - `SdpaCausal`: torch's fused CPU flash kernel (the CPU default under bf16 autocast: faster
        than eager in the demo's training step, bench/results/train_attn_cpu.json), with the lse
        gradient the kernel itself does not take added exactly in its backward;
      - `FlexCausal`: `torch.nn.attention.flex_attention` with a causal block mask, compiled on
        CUDA.  Lengths are padded up to a multiple of the block size and the kernel is compiled
        with dynamic shapes, so a run of many lengths and batch sizes compiles a handful of
        times instead of once per length (past torch's recompile limit a static compile falls
        back to eager flex, which materializes every score).
  `causal_kernel(impl, device)` builds one of them; the trainer holds it (no module-global state).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

ATTN_IMPLS = ("eager", "chunked", "flex", "sdpa")


def default_attn_impl(device, autocast: bool = False) -> str:
    """flex on CUDA (compiled flash-style kernel); on the CPU torch's fused flash kernel under bf16
    autocast (the demo's recipe, where it was measured: bench/results/train_attn_cpu.json), the
    materializing reference in fp32 (CPUs without bf16 matrix instructions, the tests' tiny drafts)."""
    if torch.device(device).type == "cuda":
        return "flex"
    return "sdpa" if autocast else "eager"


# --- the reference: materialized scores ---------------------------------------------------------
def eager_attention(qg, k, v, mask, diag_kv, scale: float):
    """qg [B, kv, g, T, hd], k/v [B, kv, Tk, hd], mask [B or 1, T, Tk] bool (True = may attend) or
    None; diag_kv: (K, V) pairs [B, kv, T, hd] of which query t sees key t only."""
    acc = torch.promote_types(qg.dtype, torch.float32)  # softmax in >= fp32 (bf16 under autocast)
    s = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2)).to(acc) * scale  # [B, kv, g, T, Tk]
    if mask is not None:
        s = s.masked_fill(~mask[:, None, None], float("-inf"))
    ds = [(qg * dk.unsqueeze(2)).sum(-1, keepdim=True).to(acc) * scale for dk, _ in diag_kv]  # [B, kv, g, T, 1]
    p = torch.softmax(torch.cat([s, *ds], dim=-1), dim=-1).to(v.dtype)
    Tk = k.shape[2]
    out = torch.matmul(p[..., :Tk], v.unsqueeze(2))
    for i, (_, dv) in enumerate(diag_kv):
        out = out + p[..., Tk + i : Tk + i + 1] * dv.unsqueeze(2)
    return out


BLOCK_SCORES_ELEMS = 1 << 26  # fp32 context scores of DFlash's block attention alive at once (256 MiB)


def block_attention(qg, ctx_k, ctx_v, blk_k, blk_v, ctx_visible, scale: float, budget: int | None = None):
    """DFlash's attention: each block of queries sees a prefix of the context keys and every key of
    its own block (non-causal inside the block), nothing of other blocks.

    qg [B, kv, g, N, S, hd] (N blocks of S queries), ctx_k/ctx_v [B, kv, T, hd], blk_k/blk_v
    [B, kv, N, S, hd], ctx_visible [B, N] int: block n sees context keys 0..ctx_visible[b, n]-1.
    Materializes [.., n*S, T] context scores for n blocks at a time, n such that they hold at most
    `budget` (BLOCK_SCORES_ELEMS) elements; under autograd each group of blocks is checkpointed, so
    backward too holds one group's scores at a time (a decoding round has N = 1: one group)."""
    B, n_kv, g, N, S, hd = qg.shape
    per_block = B * n_kv * g * S * ctx_k.shape[2]
    n = max(1, (budget or BLOCK_SCORES_ELEMS) // max(1, per_block))
    if n >= N:
        return _block_attention(qg, ctx_k, ctx_v, blk_k, blk_v, ctx_visible, scale)
    from torch.utils.checkpoint import checkpoint

    grad = torch.is_grad_enabled()
    outs = []
    for s in range(0, N, n):
        args = (qg[:, :, :, s : s + n], ctx_k, ctx_v, blk_k[:, :, s : s + n], blk_v[:, :, s : s + n], ctx_visible[:, s : s + n], scale)
        outs.append(checkpoint(_block_attention, *args, use_reentrant=False) if grad else _block_attention(*args))
    return torch.cat(outs, dim=3)


def _block_attention(qg, ctx_k, ctx_v, blk_k, blk_v, ctx_visible, scale: float):
    """block_attention over all of qg's blocks at once.  Computed in >= fp32 with autocast off: the
    inputs are small, the scores large, and casting the scores (bf16 matmul out, fp32 softmax, bf16
    matmul in) would copy them twice more."""
    B, n_kv, g, N, S, hd = qg.shape
    T = ctx_k.shape[2]
    out_dtype = qg.dtype
    acc = torch.promote_types(qg.dtype, torch.float32)
    with torch.autocast(qg.device.type, enabled=False):
        q = qg.to(acc) * scale
        sc = torch.matmul(q.reshape(B, n_kv, g, N * S, hd), ctx_k.to(acc).unsqueeze(2).transpose(-1, -2))  # [B, kv, g, N*S, T]
        seen = torch.arange(T, device=qg.device)[None, None, :] < ctx_visible[:, :, None]  # [B, N, T]
        seen = seen[:, :, None, :].expand(B, N, S, T).reshape(B, 1, 1, N * S, T)
        sc = sc.masked_fill_(~seen, float("-inf")).view(B, n_kv, g, N, S, T)  # in place: matmul's backward needs only its inputs
        sb = torch.matmul(q, blk_k.to(acc).unsqueeze(2).transpose(-1, -2))  # [B, kv, g, N, S, S]
        p = torch.softmax(torch.cat([sc, sb], dim=-1), dim=-1)  # a block's own keys: never all masked
        out = torch.matmul(p[..., :T].reshape(B, n_kv, g, N * S, T), ctx_v.to(acc).unsqueeze(2)).view(B, n_kv, g, N, S, hd)
        out = out + torch.matmul(p[..., T:], blk_v.to(acc).unsqueeze(2))
    return out.to(out_dtype)


def merge_diagonal(out_c, lse_c, qg, diag_kv, scale: float):
    """Exact merge of the diagonal keys into a causal result (out_c, lse_c):
    out = (e^lse_c out_c + sum_i e^s_i v_i) / (e^lse_c + sum_i e^s_i)."""
    if not diag_kv:
        return out_c
    acc = torch.promote_types(qg.dtype, torch.float32)
    ds = [(qg * dk.unsqueeze(2)).sum(-1).to(acc) * scale for dk, _ in diag_kv]  # [B, kv, g, T] each
    w = torch.softmax(torch.stack([lse_c.to(acc), *ds], dim=-1), dim=-1)  # [B, kv, g, T, 1 + j]
    out = w[..., 0:1] * out_c.to(acc)
    for i, (_, dv) in enumerate(diag_kv):
        out = out + w[..., i + 1 : i + 2] * dv.unsqueeze(2).to(acc)
    return out.to(out_c.dtype)


# --- chunked causal (plain torch, flash-style) ---------------------------------------------------
def chunk_rows(n_kv: int, g: int, T: int, budget: int) -> int:
    """Query rows per chunk so that one chunk's scores [B=1, kv, g*rows, T] hold ~budget elements."""
    return max(16, min(T, budget // max(1, n_kv * g * T)))


class _ChunkedCausalFn(torch.autograd.Function):
    """Causal GQA attention returning (out, lse), flash-style in plain torch.

    q [B, kv, g, T, hd], k [B, kv, T, hd], v [B, kv, T, vd] -> out [B, kv, g, T, vd] (q's dtype), lse [B, kv, g, T]
    (fp32, natural log).  Forward and backward walk query chunks; a chunk's scores
    [B, kv, g*c, e] (e = chunk end) are the largest transient.  The backward takes a gradient
    for lse too (dS = P * (dP - D + dlse)), which the exact diagonal merge needs.
    """

    @staticmethod
    def forward(ctx, q, k, v, scale: float, rows: int):
        B, n_kv, g, T, hd = q.shape
        vd = v.shape[-1]
        acc = torch.promote_types(q.dtype, torch.float32)
        out = q.new_empty(B, n_kv, g, T, vd)
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
            out[:, :, :, s:e] = torch.matmul(p, v[:, :, :e]).view(B, n_kv, g, c, vd)
            lse[:, :, :, s:e] = l.view(B, n_kv, g, c)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.rows = scale, rows
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        scale, rows = ctx.scale, ctx.rows
        B, n_kv, g, T, hd = q.shape
        vd = v.shape[-1]
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
            doc = dout[:, :, :, s:e].reshape(B, n_kv, g * c, vd)
            D = (doc.to(acc) * out[:, :, :, s:e].reshape(B, n_kv, g * c, vd).to(acc)).sum(-1, keepdim=True)
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


class ChunkedCausal:
    """Causal kernel: q [B, kv, g, T, hd], k [B, kv, T, hd], v [B, kv, T, vd] -> (out [.., vd], lse [B, kv, g, T] fp32)."""

    name = "chunked"

    def __init__(self, chunk_elems: int | None = None):
        self.chunk_elems = chunk_elems  # scores alive per query chunk (None: 2^28 on CUDA, 2^22 on CPU)

    def __call__(self, q, k, v, scale: float):
        B, n_kv, g, T, hd = q.shape
        budget = self.chunk_elems or (1 << 28 if q.is_cuda else 1 << 22)
        return _ChunkedCausalFn.apply(q, k, v, scale, chunk_rows(n_kv, g, T, budget))


# --- torch's fused CPU flash kernel ------------------------------------------------------------
def _pad_last(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))


class _SdpaCausalFn(torch.autograd.Function):
    """Causal GQA attention returning (out, lse) on aten's CPU flash kernel and its backward.

    The kernel wants one head width for q, k and v and the same number of heads: K/V are repeated per
    query head, and the narrower side is padded with zero columns (zeros in q and k leave the scores
    alone; zero value columns give zero outputs, cut off).  Its lse output carries no gradient in
    torch, and the merge of the diagonal keys needs one: the backward computes dS = P (dP - D) with
    D = rowsum(dO * O) from the O it is handed (O is read for nothing else), and the lse term makes
    it P (dP - D + dlse): the backward is handed O' = O - dlse dO / |dO|^2, whose D' is D - dlse, at
    the head width.  A row whose dO is 0 while its dlse is not (the diagonal merge never makes one)
    takes one more value column instead, O = -dlse and dO = 1 (q, k, v get a zero column there; 9 %
    slower at width 64 on a CPU).  tests/test_fastpath.py::test_fast_kernel_lse_gradient holds both
    ways to the reference in fp64."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float):
        B, n_kv, g, T, hd = q.shape
        vd = v.shape[-1]
        w = max(hd, vd)
        qh = _pad_last(q.reshape(B, n_kv * g, T, hd), w)
        kh, vh = (_pad_last(x.repeat_interleave(g, dim=1) if g > 1 else x, w) for x in (k, v))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qh, kh, vh, 0.0, True, scale=scale)
        ctx.save_for_backward(qh, kh, vh, out, lse)
        ctx.scale, ctx.dims = scale, (B, n_kv, g, T, hd, vd)
        return out[..., :vd].reshape(B, n_kv, g, T, vd), lse.reshape(B, n_kv, g, T)

    @staticmethod
    def backward(ctx, dout, dlse):
        qh, kh, vh, out, lse = ctx.saved_tensors
        B, n_kv, g, T, hd, vd = ctx.dims
        w = out.shape[-1]
        dout = out.new_zeros(B, n_kv * g, T, w) if dout is None else _pad_last(dout.reshape(B, n_kv * g, T, vd), w)
        if dlse is not None:
            acc = torch.promote_types(out.dtype, torch.float32)
            dl, do = dlse.reshape(lse.shape).to(acc)[..., None], dout.to(acc)
            n2 = (do * do).sum(-1, keepdim=True)
            if bool(((n2 < 1e-30) & (dl != 0)).any()):  # the CPU's host sync: free
                qh, kh, vh = (_pad_last(x, w + 1) for x in (qh, kh, vh))
                out = torch.cat([out, (-dl).to(out.dtype)], -1)
                dout = torch.cat([dout, torch.ones_like(dout[..., :1])], -1)
            else:
                out = (out.to(acc) - dl * do / n2.clamp_min(1e-30)).to(out.dtype)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.contiguous(), qh, kh, vh, out, lse, 0.0, True, scale=ctx.scale)
        dq, dk, dv = dq[..., :hd], dk[..., :hd], dv[..., :vd]
        if g > 1:  # the repeated K/V heads: their gradients add up
            dk, dv = dk.reshape(B, n_kv, g, T, hd).sum(2), dv.reshape(B, n_kv, g, T, vd).sum(2)
        return dq.reshape(B, n_kv, g, T, hd), dk, dv, None


class SdpaCausal:
    """Causal kernel on torch's fused CPU flash attention: q [B, kv, g, T, hd], k [B, kv, T, hd],
    v [B, kv, T, vd] -> (out [.., vd], lse [B, kv, g, T] fp32).  CPU only (flex is CUDA's): causal_kernel
    refuses it for another device."""

    name = "sdpa"

    def __call__(self, q, k, v, scale: float):
        return _SdpaCausalFn.apply(q, k, v, scale)  # the kernel's lse is fp32 for bf16 inputs, fp64 for fp64


# --- flex attention ----------------------------------------------------------------------------
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


def bucket_length(T: int, block: int = 128) -> int:
    """T rounded up to a whole number of flex blocks."""
    return -(-T // block) * block


class FlexCausal:
    """Causal kernel on flex_attention.  Padding T up to `bucket_length(T)` is exact: the padded
    keys come after every real query, so the causal mask already hides them, and the padded query
    rows are cut off (no gradient flows back from them).  `compile`: None = on CUDA only (eager
    flex materializes the scores); `backend`: torch.compile backend (tests count compiles)."""

    name = "flex"

    def __init__(self, compile: bool | None = None, backend: str | None = None, block: int = 128, masks_kept: int = 8):
        self.compile, self.backend, self.block = compile, backend, block
        self.masks: OrderedDict = OrderedDict()  # (padded T, device) -> BlockMask, least recently used first
        self.masks_kept = masks_kept
        self._compiled = None

    def block_mask(self, T: int, device):
        key = (T, str(device))
        bm = self.masks.pop(key, None)
        if bm is None:
            bm = causal_block_mask(T, device, self.block)
        self.masks[key] = bm
        while len(self.masks) > self.masks_kept:
            self.masks.popitem(last=False)
        return bm

    def _fn(self, device):
        from torch.nn.attention import flex_attention as fa

        if not (self.compile if self.compile is not None else device.type == "cuda"):
            return fa.flex_attention
        if self._compiled is None:
            # dynamic shapes: one graph serves every (B, T) bucket; a static compile recompiles per
            # length and, past torch's recompile limit, silently runs eager flex
            kw = {"backend": self.backend} if self.backend else {}
            self._compiled = torch.compile(fa.flex_attention, dynamic=True, **kw)
        return self._compiled

    def __call__(self, q, k, v, scale: float):
        from torch.nn.attention import flex_attention as fa

        B, n_kv, g, T, hd = q.shape
        Tp = bucket_length(T, self.block)
        q = q.reshape(B, n_kv * g, T, hd)
        if Tp != T:
            pad = (0, 0, 0, Tp - T)
            q, k, v = (torch.nn.functional.pad(x, pad) for x in (q, k, v))
        kw = dict(block_mask=self.block_mask(Tp, q.device), scale=scale, enable_gqa=g > 1)
        fn = self._fn(q.device)
        if hasattr(fa, "AuxRequest"):
            out, aux = fn(q, k, v, return_aux=fa.AuxRequest(lse=True), **kw)
            lse = aux.lse
        else:
            out, lse = fn(q, k, v, return_lse=True, **kw)
        out, lse = out[:, :, :T], lse[:, :, :T]
        return out.reshape(B, n_kv, g, T, out.shape[-1]), lse.reshape(B, n_kv, g, T).float()


def causal_kernel(impl: str, device=None):
    """The training attention kernel for `impl` (None for "eager": the reference path)."""
    if impl == "eager":
        return None
    if impl == "chunked":
        return ChunkedCausal()
    if impl == "flex":
        return FlexCausal()
    if impl == "sdpa":
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError("attn_impl sdpa is the CPU kernel: use flex or chunked on CUDA")
        return SdpaCausal()
    raise ValueError(f"attn_impl must be one of {ATTN_IMPLS} (got {impl!r})")


def causal_attention_lse(q, k, v, scale: float, impl: str, chunk_elems: int | None = None):
    """q [B, kv, g, T, hd], k [B, kv, T, hd], v [B, kv, T, vd] -> (out [B, kv, g, T, vd], lse [B, kv, g, T] fp32)."""
    if impl == "chunked":
        return ChunkedCausal(chunk_elems)(q, k, v, scale)
    kern = causal_kernel(impl)
    if kern is None:
        raise ValueError(f"attn_impl must be chunked, flex or sdpa for (out, lse) (got {impl!r})")
    return kern(q, k, v, scale)
