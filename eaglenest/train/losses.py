"""Training losses of a draft against the target, and the fused draft head that computes them.

`head_loss` is the one home of a draft's output loss (the EAGLE-3 TTT loop in ttt.py and DFlash's
block objective both call it): the lm_head matmul and the loss of rows of normed draft states, one
chunk of rows at a time, with the gradients with respect to the states and the head's weight
computed in the forward (no [rows, Vd] logits tensor is kept for backward or recomputed there).
Per chunk it reads draft logits z [c, Vd] (over the draft vocabulary) and either the matching rows
of the teacher (`SoftTarget`: `TeacherRows` from `Teacher.targets` in ttt.py, under a `LossSpec`
mix) or hard labels (`HardTarget`, DFlash); the gradients with respect to z are written out by hand.

Which target distribution each loss uses, and why:
  * p  = the target's softmax over its FULL vocabulary, restricted to the draft vocabulary (not
    renormalized: it sums to S <= 1, S = the target's mass inside the draft vocabulary).  This is
    what speculative sampling sees: the draft can only propose draft-vocabulary tokens, so the
    acceptance probability is alpha = sum_v min(p_v, q_v) over the draft vocabulary, at most S.
    Renormalizing would overstate alpha wherever the target puts mass outside the draft vocabulary.
    `tv`, `nla` and the TV part and the lambda of `lk_hybrid` use p.
  * p^ = p / S, the target's distribution renormalized over the draft vocabulary.  `ce` and `kl`
    (and the KL part of `lk_hybrid`) use it: the best draft under KL(p || q) over the draft
    vocabulary is q = p^ either way, and soft cross-entropy against p^ is what eaglenest has always
    trained with (the demo's tau was measured with it; tests/test_losses.py pins `ce` to the
    previous implementation).  KL(p^ || q) = CE(p^, q) - H(p^): the same gradient as `ce`.
  q = softmax(z), the draft's distribution.

The losses (per position; a chunk sums w_i * loss_i):
  ce         -sum p^ log q                        grad  q - p^
  kl         KL(p^ || q)                          grad  q - p^
  tv         1 - alpha  (= TV(p, q) over the full vocabulary: q has no mass outside the draft's)
  nla        -log alpha                           (LK, arXiv 2602.23881)
  lk_hybrid  lam * KL(p^ || q) + (1 - lam) * (1 - alpha),  lam = exp(-eta * sg(alpha))  (LK)
with d alpha / dz = q * (m - <m, q>), m = [q < p] (the tokens where the draft is the smaller one).
|d(-log alpha)/dz|_1 <= 2 for every alpha > 0 (the q-mass where q < p is at most alpha), so nla
needs no clipping; alpha is floored at 1e-30 only against 0/0 where it underflows.

Memory (per chunk of c rows): transient >= fp32 [c, Vd] tensors (q, p^, for the alpha losses p,
their minimum, the mask): ~16 c Vd bytes for ce/kl, ~26 c Vd for the alpha losses; kept until
backward, the rows' and the head's gradients.  `chunk_rows` keeps c x Vd at LOSS_CHUNK_ELEMS, so a
163,840-token vocabulary (Kimi-K2.5, no reduced draft vocabulary) runs 819-row chunks instead of
4096.  The formula of the whole step is `loss_step_bytes`.

Where the rows' work runs: on CUDA the Triton kernels (loss_kernels.py); on a CPU under bf16, `ce`
with p^ cached and hard labels run torch.compile'd (`_ce_rows`, `_hard_rows`: one loop nest per
chunk where the eager ops make ~10 passes over fp32 copies; built by inductor with the system's C++
compiler, seconds once per machine); everything else on the eager torch path below.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from eaglenest import EaglenestError
from eaglenest.models.target import soft_cap

KINDS = ("ce", "kl", "tv", "nla", "lk_hybrid")
ALPHA_KINDS = ("tv", "nla", "lk_hybrid")  # need p, i.e. the teacher's full-vocabulary log-sum-exp
LOSS_CHUNK_ELEMS = 1 << 27  # rows x draft vocabulary of one loss chunk (fp32: 512 MiB per [c, Vd] tensor)
PROBS_CACHE_BYTES = 1 << 28  # a micro-batch's fp32 p^ is kept whole up to this size (TeacherRows.probs_cache)
ALPHA_FLOOR = 1e-30
HEAD_GRAD_FP32_BYTES = 1 << 30  # the head's gradient sums its row chunks in fp32 up to this size (every Llama/Qwen draft
# vocabulary), in the weight's dtype beyond (Kimi-K2.5's 163,840 x 7168 head would need 4.7 GB more)


def chunk_rows(default: int, draft_vocab: int) -> int:
    """Rows of draft logits alive at once: `default` (1024 on CPU, 4096 on CUDA), fewer for a large
    vocabulary so that rows x vocab <= LOSS_CHUNK_ELEMS (Llama-3's 128K: 1024; Kimi's 163,840: 819)."""
    return max(16, min(default, LOSS_CHUNK_ELEMS // max(1, draft_vocab)))


def loss_step_bytes(N: int, V: int, Vd: int, H: int, c: int, ct: int, mass: bool, alpha_loss: bool) -> int:
    """Upper bound of the tensor bytes of the teacher + the fused head and loss under bf16
    (Teacher.targets of N positions, then `head_loss` over N rows in c-row chunks, forward and
    backward), ct = TEACHER_CHUNK_ELEMS // V teacher rows, `mass` = the log-sum-exp is computed,
    `alpha_loss` = tv/nla/lk_hybrid in the mix.  Counted op by op on the meta device,
    tests/test_losses.py checks the bound:
      kept by the teacher   N (2 Vd + 8 + 4 mass)              bf16 logits, argmax, log-mass
                            + 4 N Vd if that is <= PROBS_CACHE_BYTES (the p^ cache)
      teacher's transient   ct (V (4 + 2 mass) + 4 Vd mass)    0 when Vd = V (one head matmul)
      the head and loss     4 u c Vd + 2 N H + (2 + 4 s) Vd H  u = 4 (ce, kl) or 6.5 (alpha losses): one chunk's
                            + 32 N + 2 c H                     (per-row values: loss, argmax, alpha, ...; a chunk's
                                                               rows scaled by their coefficients);
                                                               fp32 logits and their transients; 2 N H: the rows'
                                                               gradient, 2 Vd H the head's, both kept from the
                                                               forward to backward; s = 1 when the head's gradient
                                                               is summed in fp32 (<= HEAD_GRAD_FP32_BYTES, N > c)
      peak <= kept + max(teacher's transient, the head and loss).
    Kimi-K2.5 (V = Vd = 163,840, H = 7168) at N = 8192: c = ct = 819, 2.5 GiB kept."""
    full = V == Vd
    kept = N * (2 * Vd + 8 + 4 * mass) + (4 * N * Vd if 4 * N * Vd <= PROBS_CACHE_BYTES else 0)
    teacher = 0 if full else ct * (V * (4 + 2 * mass) + 4 * Vd * mass)
    fp32_sum = N > c and 4 * Vd * H <= HEAD_GRAD_FP32_BYTES
    loss = int(4 * (6.5 if alpha_loss else 4) * c * Vd) + 2 * N * H + (2 + 4 * fp32_sum) * Vd * H + 32 * N + 2 * c * H
    return kept + max(teacher, loss)


# ----------------------------------------------------------------------------------------------
# what the losses read of the teacher


@dataclass
class TeacherRows:
    """The target's output at N positions, as `Teacher.targets` computes it once per micro-batch.

    logits: [N, Vd] the target head's draft-vocabulary rows, before soft-capping, in the teacher's
        matmul dtype (bf16 when training under bf16: that is the matmul's own output, nothing is
        lost; fp32 otherwise).
    probs_cache: [N, Vd] fp32 p^, computed once per micro-batch when it is small (at most
        PROBS_CACHE_BYTES: every CPU recipe; 32 MiB in the demo), so the TTT steps read it instead
        of forming it again per chunk, forward and backward (+25 % of a CPU step otherwise); None
        for a large vocabulary (Kimi-K2.5: 5 GiB at 8K tokens), whose chunks form p^ themselves.
        The same values either way (a row's softmax does not depend on the chunk).
    log_mass: [N] fp32 log S, S = the target's probability mass inside the draft vocabulary
        (0 when the draft vocabulary is the whole vocabulary); None when not computed (a `ce`/`kl`
        run's training batches: the full-vocabulary log-sum-exp costs a pass over [N, V]).
    argmax: [N] the target's argmax over its full vocabulary (target ids).
    softcap: the target's logit soft-cap (Gemma 2), applied when probabilities are formed."""

    logits: torch.Tensor
    argmax: torch.Tensor
    log_mass: torch.Tensor | None = None
    softcap: float | None = None
    probs_cache: torch.Tensor | None = None

    @classmethod
    def from_probs(cls, probs: torch.Tensor, argmax: torch.Tensor, log_mass: torch.Tensor | None = None) -> "TeacherRows":
        """Rows from given probabilities over the draft vocabulary [..., Vd] (tests, experiments):
        their logs are logits whose softmax gives them back."""
        return cls(probs.reshape(-1, probs.shape[-1]).clamp_min(1e-30).log(), argmax.reshape(-1),
                   None if log_mass is None else log_mass.reshape(-1))

    def probs(self, rows: torch.Tensor) -> torch.Tensor:
        """p^ [len(rows), Vd] fp32 (or the logits' dtype if wider): renormalized over the draft vocabulary."""
        if self.probs_cache is not None:
            return self.probs_cache.index_select(0, rows)
        z = self.logits.index_select(0, rows)
        return torch.softmax(soft_cap(z.to(torch.promote_types(z.dtype, torch.float32)), self.softcap), dim=-1)

    def mass(self, rows: torch.Tensor) -> torch.Tensor:
        if self.log_mass is None:
            raise EaglenestError("this loss needs the target's full-vocabulary log-sum-exp: Teacher.targets(..., mass=True)")
        return self.log_mass.index_select(0, rows).exp()

    def view_rows(self) -> int:
        return self.logits.shape[0]


# ----------------------------------------------------------------------------------------------
# a loss, or a weighted mix of losses


@dataclass(frozen=True)
class LossSpec:
    """`terms`: ((kind, weight), ...); `eta`: lk_hybrid's lambda = exp(-eta * sg(alpha))."""

    terms: tuple[tuple[str, float], ...] = (("ce", 1.0),)
    eta: float = 3.0

    @classmethod
    def parse(cls, text: str, eta: float = 3.0) -> "LossSpec":
        """'ce', 'lk_hybrid', or a weighted mix 'ce:0.1,tv:0.9' (a name alone weighs 1)."""
        terms = []
        for part in str(text).replace(" ", "").split(","):
            if not part:
                continue
            name, _, w = part.partition(":")
            if name not in KINDS:
                raise EaglenestError(f"--loss: unknown loss {name!r} in {text!r}; one of {', '.join(KINDS)}, or a mix like 'ce:0.1,tv:0.9'")
            try:
                weight = float(w) if w else 1.0
            except ValueError:
                raise EaglenestError(f"--loss: weight {w!r} of {name} is not a number (in {text!r})") from None
            if not weight > 0:
                raise EaglenestError(f"--loss: weight of {name} must be positive (got {w} in {text!r})")
            if any(name == n for n, _ in terms):
                raise EaglenestError(f"--loss: {name} appears twice in {text!r}")
            terms.append((name, weight))
        if not terms:
            raise EaglenestError(f"--loss: empty loss {text!r}")
        if not eta >= 0:
            raise EaglenestError(f"--lk-eta must be >= 0 (got {eta})")
        return cls(tuple(terms), float(eta))

    def __str__(self) -> str:
        if len(self.terms) == 1 and self.terms[0][1] == 1.0:
            return self.terms[0][0]
        return ",".join(f"{n}:{w:g}" for n, w in self.terms)

    @property
    def needs_alpha(self) -> bool:
        return any(n in ALPHA_KINDS for n, _ in self.terms)

    def weight(self, kind: str) -> float:
        return sum(w for n, w in self.terms if n == kind)


def normalize_loss(text: str) -> str:
    """The config's `loss` value, checked and written canonically (the CLI/YAML parser: argparse and
    the YAML reader report an ArgumentTypeError with the flag, or the file and line)."""
    import argparse

    try:
        return str(LossSpec.parse(text))
    except EaglenestError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--loss: ")) from None


# ----------------------------------------------------------------------------------------------
# per-row values and gradients with respect to the logits


ROW_MAX_BLOCK = 256  # columns per block of row_max's first pass (of 256 to 4096, the fastest on a 49K-wide bf16 row)


def row_max(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """z.max(-1) of 2-D logits: (values, the index of the first maximum), the same values and indices,
    ties included.  On the CPU in two passes, each block's maximum without indices (amax), then the
    index inside the first block holding the row's maximum: there torch's max with indices is several
    times slower than amax over wide rows (the teacher's full-vocabulary argmax, the draft's per loss
    chunk).  Elsewhere torch's own.  A row holding a NaN is not supported (max would point
    at the NaN; these logits feed a softmax, where it fails anyway)."""
    B = ROW_MAX_BLOCK
    V = z.shape[-1]
    if z.device.type != "cpu" or z.dim() != 2 or V < 2 * B:
        return tuple(z.max(-1))
    full = V // B
    blocks = z.view(-1, full, B) if full * B == V and z.is_contiguous() else z.unfold(1, B, B)  # views (unfold's amax is slower)
    bm = blocks.amax(-1)  # [N, full]; a tail is a block of its own
    if full * B < V:
        bm = torch.cat([bm, z[:, full * B:].amax(-1, keepdim=True)], 1)
    m, first = bm.max(-1)  # the first block holding the maximum
    start = first * B
    idx = (start[:, None] + torch.arange(B, device=z.device)).clamp_max_(V - 1)  # a short tail repeats its last column
    return m, start + z.gather(1, idx).max(-1).indices


def _softmax_parts(z: torch.Tensor, ph: torch.Tensor | None):
    """z [c, Vd] (any float dtype) -> (q = softmax(z) in >= fp32, log-sum-exp, the argmax, <z, ph> - lse or
    None): the max (and argmax) over z as it came from the matmul, then one >= fp32 buffer worked on in place
    (z itself when it is >= fp32: the caller's logits are consumed)."""
    m, arg = row_max(z)
    e = z.to(torch.promote_types(z.dtype, torch.float32)).sub_(m[:, None])  # z - max, exactly (same-dtype ops: vectorized)
    dot = None if ph is None else torch.linalg.vecdot(e, ph)  # <z, ph> - max (ph sums to 1)
    s = e.exp_().sum(-1)
    logs = s.log()
    return e.mul_(s.reciprocal_()[:, None]), m.to(e.dtype) + logs, arg, None if dot is None else dot - logs


def _rows_softmax(z: torch.Tensor):
    """The softmax pieces both compiled rows functions share: (z - max in fp32, its exp, their row sums,
    the argmax) of bf16 logits z [c, Vd]."""
    zf = z.float()
    m, arg = zf.max(-1)
    e = zf - m[:, None]
    ex = e.exp()
    return e, ex, ex.sum(-1), arg


def _ce_rows(z: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor):
    """`ce` of bf16 logits z [c, Vd] against the p^ rows `rows` of the teacher's cache -> (loss [c] fp32,
    dz = q - p^ in z's dtype, the draft's argmax [c]): soft_rows' arithmetic, written for torch.compile,
    which makes it one loop nest reading z and the gathered p^ twice (the eager ops make ~10 passes
    over fp32 [c, Vd] copies)."""
    ph = cache.index_select(0, rows)
    e, ex, s, arg = _rows_softmax(z)
    return s.log() - (e * ph).sum(-1), (ex / s[:, None] - ph).to(z.dtype), arg


def _hard_rows(z: torch.Tensor, labels: torch.Tensor):
    """hard_rows' arithmetic for torch.compile (as _ce_rows): bf16 logits z [c, Vd], draft ids `labels` [c]
    -> (loss [c] fp32, dz = softmax - onehot in z's dtype, the draft's argmax [c])."""
    e, ex, s, arg = _rows_softmax(z)
    hot = torch.arange(z.shape[1], device=z.device)[None, :] == labels[:, None]
    return s.log() - e.gather(1, labels[:, None])[:, 0], (ex / s[:, None] - hot.float()).to(z.dtype), arg


_COMPILED: dict = {}  # a rows function's name -> its compiled form, or the error that stopped its compile (the torch path runs then)


def _compiled_rows(fn, z: torch.Tensor, grad_dtype, *args):
    """fn(z, *args) compiled (fn: _ce_rows or _hard_rows) where it applies: a CPU training chunk of bf16
    logits, not switched off (EAGLENEST_LOSS_KERNEL=torch).  None elsewhere, and once its build failed
    (no C++ compiler, or inductor refused: said once), where the caller's eager path gives the same
    numbers up to rounding."""
    name = fn.__name__
    if not (z.device.type == "cpu" and z.dtype == torch.bfloat16 and grad_dtype == torch.bfloat16
            and os.environ.get("EAGLENEST_LOSS_KERNEL", "auto") != "torch") or isinstance(_COMPILED.get(name), str):
        return None
    compiled = _COMPILED.get(name)
    if compiled is None:
        compiled = _COMPILED[name] = torch.compile(fn, dynamic=True, fullgraph=True)
    try:
        return compiled(z, *args)
    except Exception as e:
        _COMPILED[name] = f"{type(e).__name__}: {e}"
        from tqdm.auto import tqdm

        tqdm.write(f"warning: the compiled loss did not build ({_COMPILED[name][:300]}); the eager torch path runs", file=sys.stderr)
        return None


def soft_rows(z: torch.Tensor, teacher: TeacherRows, rows: torch.Tensor, spec: LossSpec, grad_dtype: torch.dtype | None,
              want_alpha: bool):
    """Soft-label losses of draft logits z [c, Vd] (consumed) against teacher rows `rows` [c] -> (loss [c] (the mix,
    per row, >= fp32), dz [c, Vd] = d loss_i / dz_i in `grad_dtype` (None: not computed), the draft's
    argmax [c], alpha [c] or None, p(draft argmax) [c] or None).  The gradient is written out (module
    docstring): autograd would keep four [c, Vd] tensors per row chunk."""
    cache = teacher.probs_cache
    if spec.terms == (("ce", 1.0),) and not want_alpha and cache is not None and cache.dtype == torch.float32:
        r = _compiled_rows(_ce_rows, z, grad_dtype, cache, rows)  # the demo's training step
        if r is not None:
            return (*r, None, None)
    acc = torch.promote_types(z.dtype, torch.float32)
    ph = teacher.probs(rows).to(acc)
    need_alpha = spec.needs_alpha or want_alpha
    need_ce = bool(spec.weight("ce") or spec.weight("kl") or spec.weight("lk_hybrid"))
    q, _, arg, dot = _softmax_parts(z, ph if need_ce else None)
    per = {}
    if need_ce:
        per["ce"] = -dot  # lse - <z, p^>
    if spec.weight("kl") or spec.weight("lk_hybrid"):
        t = soft_cap(teacher.logits.index_select(0, rows).to(acc), teacher.softcap)
        per["kl"] = per["ce"] - (torch.logsumexp(t, dim=-1) - torch.linalg.vecdot(t, ph))  # - H(p^)
        del t
    alpha = pt_arg = m = None
    if need_alpha:
        S = teacher.mass(rows).to(acc)
        p = ph * S[:, None]
        alpha = torch.minimum(p, q).sum(-1)
        pt_arg = ph.gather(1, arg[:, None])[:, 0] * S  # accepted with this probability when the draft proposes its argmax
        if grad_dtype is not None and spec.needs_alpha:
            m = q < p  # where the draft is the smaller one (d alpha / dz)
        del p
    loss = None
    for name, c in spec.terms:
        if name in ("ce", "kl"):
            v = per[name]
        elif name == "tv":
            v = 1.0 - alpha
        elif name == "nla":
            v = -alpha.clamp_min(ALPHA_FLOOR).log()
        else:  # lk_hybrid
            lam = torch.exp(-spec.eta * alpha)
            v = lam * per["kl"] + (1.0 - lam) * (1.0 - alpha)
        v = v if c == 1.0 else c * v
        loss = v if loss is None else loss + v
    if grad_dtype is None:
        return loss, None, arg, alpha, pt_arg
    c_kl = spec.weight("ce") + spec.weight("kl")
    if not spec.needs_alpha:  # ce, kl and their mixes: c_kl (q - p^), written straight in the gradient's dtype
        dz = q.sub_(ph) if c_kl == 1.0 else q.sub_(ph).mul_(c_kl)
        return loss, dz.to(grad_dtype), arg, alpha, pt_arg
    # grad = c_kl (q - p^) + c_alpha dalpha/dz, dalpha/dz = q (m - A), m = [q < p], A = <m, q>, i.e.
    # q * (c_kl - c_alpha A + c_alpha m) - c_kl p^, with per-row c_kl and c_alpha
    c_kl = torch.full_like(alpha, c_kl)
    mf = m.to(q.dtype)
    del m
    A = torch.linalg.vecdot(q, mf)
    c_alpha = torch.zeros_like(alpha)
    if spec.weight("tv"):
        c_alpha -= spec.weight("tv")
    if spec.weight("nla"):
        c_alpha -= spec.weight("nla") / alpha.clamp_min(ALPHA_FLOOR)
    if spec.weight("lk_hybrid"):
        lam = torch.exp(-spec.eta * alpha)  # sg(alpha): lambda is a constant of the gradient
        c_alpha -= spec.weight("lk_hybrid") * (1.0 - lam)
        c_kl = c_kl + spec.weight("lk_hybrid") * lam
    grad = mf.mul_(c_alpha[:, None]).add_((c_kl - c_alpha * A)[:, None]).mul_(q)
    if need_ce:
        grad.addcmul_(ph, c_kl[:, None], value=-1.0)
    return loss, grad.to(grad_dtype), arg, alpha, pt_arg


def hard_rows(z: torch.Tensor, labels: torch.Tensor, grad_dtype: torch.dtype | None):
    """Hard-label cross-entropy of logits z [c, Vd] (consumed) against draft ids `labels` [c] -> (loss [c] >= fp32,
    dz = softmax - onehot in `grad_dtype` or None, the draft's argmax [c])."""
    r = _compiled_rows(_hard_rows, z, grad_dtype, labels)
    if r is not None:
        return r
    zl = z.gather(1, labels[:, None])[:, 0]
    q, lse, arg, _ = _softmax_parts(z, None)
    loss = lse - zl.to(lse.dtype)
    if grad_dtype is None:
        return loss, None, arg
    q.scatter_add_(1, labels[:, None], torch.full_like(lse[:, None], -1.0))
    return loss, q.to(grad_dtype), arg


# ----------------------------------------------------------------------------------------------
# the fused draft head + loss: the one home of a draft's output loss (EAGLE-3's TTT, DFlash's blocks)


@dataclass
class SoftTarget:
    """The teacher's distribution at teacher rows `rows` [R] under the loss `spec`."""

    teacher: TeacherRows
    rows: torch.Tensor
    spec: LossSpec = LossSpec()


@dataclass
class HardTarget:
    """Hard labels: draft ids [R] (DFlash)."""

    labels: torch.Tensor


def use_kernels(z: torch.Tensor) -> bool:
    """Whether a chunk's loss runs on the Triton kernels (loss_kernels.py): a CUDA tensor (or Triton's
    interpreter), contiguous rows, Triton installed, and not switched off (EAGLENEST_LOSS_KERNEL=torch)."""
    if os.environ.get("EAGLENEST_LOSS_KERNEL", "auto") == "torch" or z.stride(-1) != 1:
        return False
    if not (z.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    return importlib.util.find_spec("triton") is not None


def _rows_chunk(target, s: int, e: int, z: torch.Tensor, grad_dtype, want_alpha: bool):
    """One chunk's per-row losses and logits gradient: on CUDA the Triton kernels where they cover the
    loss (loss_kernels.py; the gradient overwrites z), else the torch path."""
    grad = grad_dtype is not None
    if use_kernels(z):
        from eaglenest.train import loss_kernels

        if isinstance(target, HardTarget):
            return (*loss_kernels.hard_rows(z, target.labels[s:e], grad), None, None)
        if not want_alpha:
            r = loss_kernels.soft_rows(z, target.teacher, target.rows[s:e], target.spec, grad)
            if r is not None:
                return (*r, None, None)
    if isinstance(target, HardTarget):
        loss, dz, arg = hard_rows(z, target.labels[s:e], grad_dtype)
        return loss, dz, arg, None, None
    return soft_rows(z, target.teacher, target.rows[s:e], target.spec, grad_dtype, want_alpha)


class _HeadLoss(torch.autograd.Function):
    """sum_i coef_i loss_i(softmax(h_i W^T)), its gradients with respect to h and W computed in the
    forward, one chunk of rows at a time: no [rows, Vd] logits tensor outlives its chunk, none is
    kept for backward or recomputed there; backward scales the stored gradients by the upstream one."""

    @staticmethod
    def forward(ctx, h_in, weight, coef, target, want_alpha: bool, chunk: int, grads: tuple[bool, bool], cdt):
        grad_h, grad_w = grads
        need = grad_h or grad_w
        dev = h_in.device.type
        with torch.autocast(dev, enabled=False) if torch.amp.is_autocast_available(dev) else nullcontext():  # explicit `cdt`
            return _HeadLoss._forward(ctx, h_in.to(cdt), weight, coef, target, want_alpha, chunk, grad_h, grad_w, need, h_in.dtype)

    @staticmethod
    def _forward(ctx, h, weight, coef, target, want_alpha, chunk, grad_h, grad_w, need, h_dtype):
        w = weight.to(h.dtype)
        acc = torch.promote_types(h.dtype, torch.float32)
        R = h.shape[0]
        loss = torch.empty(R, dtype=acc, device=h.device)
        arg = torch.empty(R, dtype=torch.long, device=h.device)
        alpha = pt_arg = None
        gh = torch.empty_like(h) if grad_h else None
        gw = None
        if grad_w and R > chunk:  # the head's gradient summed over chunks: in fp32 while that is small
            gw = torch.zeros_like(weight, dtype=acc if weight.numel() * 4 <= HEAD_GRAD_FP32_BYTES else weight.dtype)
        for s in range(0, R, chunk):
            e = min(R, s + chunk)
            l, dz, a, al, pa = _rows_chunk(target, s, e, h[s:e] @ w.T, h.dtype if need else None, want_alpha)
            loss[s:e], arg[s:e] = l, a
            if al is not None:
                if alpha is None:
                    alpha, pt_arg = loss.new_empty(R), loss.new_empty(R)
                alpha[s:e], pt_arg[s:e] = al, pa
            if need:  # dz is per unit coefficient: the rows' coefficients scale [c, H] tensors, not [c, Vd]
                cc = coef[s:e].to(h.dtype)[:, None]
                if grad_h:  # (W^T dz^T)^T: oneDNN runs it ~2x faster than dz W when the reduction is the vocabulary
                    torch.mul((w.T @ dz.T).T, cc, out=gh[s:e])
                if grad_w:
                    hc = h[s:e] * cc
                    if gw is None:
                        gw = dz.T @ hc
                    elif gw.dtype == h.dtype:
                        gw.addmm_(dz.T, hc)
                    else:
                        gw.add_(dz.T @ hc)
        if grad_w:  # kept until backward in the weight's own dtype
            gw = torch.zeros_like(weight) if gw is None else gw.to(weight.dtype)
        if grad_h:
            gh = gh.to(h_dtype)
        ctx.save_for_backward(*(x for x in (gh, gw) if x is not None))
        ctx.has, ctx.done = (grad_h, grad_w), False
        empty = loss.new_empty(0)
        out = torch.linalg.vecdot(loss, coef.to(acc)) if R else loss.sum()
        alpha, pt_arg = (empty, empty) if alpha is None else (alpha, pt_arg)
        ctx.mark_non_differentiable(loss, arg, alpha, pt_arg)
        return out, loss, arg, alpha, pt_arg

    @staticmethod
    def backward(ctx, g, *_):
        if ctx.done:
            raise RuntimeError("the fused head + loss scales its stored gradients in place: it cannot run backward twice")
        ctx.done = True
        saved = iter(ctx.saved_tensors)
        # in place (no second [Vd, H] copy); a 0-dim g keeps the gradients' dtype
        gh = next(saved).mul_(g) if ctx.has[0] else None
        gw = next(saved).mul_(g) if ctx.has[1] else None
        return gh, gw, None, None, None, None, None, None


def head_loss(h: torch.Tensor, weight: torch.Tensor, target, coef: torch.Tensor, chunk: int, want_alpha: bool = False):
    """The draft head and its loss in one pass: h [R, H] (the normed state, rows with a loss), the
    head's weight [Vd, H], `target` (SoftTarget or HardTarget), per-row coefficients coef [R] (the
    loss weight times the row's normalizer) -> (sum_i coef_i loss_i (differentiable in h and the
    weight), loss [R], the draft's argmax [R], alpha [R] and p(draft argmax) [R] (empty unless the
    loss needs them or `want_alpha`)).  `chunk`: rows of logits alive at once (`chunk_rows`).  The
    logits are computed in h's dtype (bf16 when training in bf16), the loss in >= fp32."""
    if isinstance(target, SoftTarget) and (target.spec.needs_alpha or want_alpha):
        target.teacher.mass(target.rows[:0])  # the clear error when the log-mass was not computed
    on, dev = torch.is_grad_enabled(), h.device.type
    autocast = torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev)
    cdt = torch.get_autocast_dtype(dev) if autocast else h.dtype  # bf16 under autocast, as a Linear would
    return _HeadLoss.apply(h, weight, coef, target, want_alpha, max(1, chunk), (on and h.requires_grad, on and weight.requires_grad), cdt)
