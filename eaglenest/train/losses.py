"""Training losses of a draft against the target, one chunk of positions at a time.

Every loss here reads one chunk of draft logits z [c, Vd] (over the draft vocabulary) and the
matching rows of the teacher (`TeacherRows`, from `Teacher.targets` in ttt.py), and returns the
weighted sum over the chunk with a hand-written gradient: the EAGLE-3 TTT loop (ttt.py) and a
block objective (DFlash) call the same `chunk_loss`.  Mixes are weighted sums (`LossSpec`).

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

Memory (per chunk of c rows): the draft logits upcast to fp32 (saved for backward, as in the former
SoftCrossEntropy) plus transient fp32 [c, Vd] tensors (p^, q, p, their minimum, the gradient):
~16 c Vd bytes for ce/kl, ~26 c Vd for the alpha losses.  `chunk_rows` keeps c x Vd at
LOSS_CHUNK_ELEMS, so a 163,840-token vocabulary (Kimi-K2.5, no reduced draft vocabulary) runs
819-row chunks instead of 4096.  The formula of the whole step is `loss_step_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eaglenest import EaglenestError
from eaglenest.models.target import soft_cap

KINDS = ("ce", "kl", "tv", "nla", "lk_hybrid")
ALPHA_KINDS = ("tv", "nla", "lk_hybrid")  # need p, i.e. the teacher's full-vocabulary log-sum-exp
LOSS_CHUNK_ELEMS = 1 << 27  # rows x draft vocabulary of one loss chunk (fp32: 512 MiB per [c, Vd] tensor)
PROBS_CACHE_BYTES = 1 << 28  # a micro-batch's fp32 p^ is kept whole up to this size (TeacherRows.probs_cache)
ALPHA_FLOOR = 1e-30


def chunk_rows(default: int, draft_vocab: int) -> int:
    """Rows of draft logits alive at once: `default` (1024 on CPU, 4096 on CUDA), fewer for a large
    vocabulary so that rows x vocab <= LOSS_CHUNK_ELEMS (Llama-3's 128K: 1024; Kimi's 163,840: 819)."""
    return max(16, min(default, LOSS_CHUNK_ELEMS // max(1, draft_vocab)))


def loss_step_bytes(N: int, V: int, Vd: int, H: int, c: int, ct: int, mass: bool, alpha_loss: bool) -> int:
    """Upper bound of the tensor bytes of the teacher + one loss step under bf16 (Teacher.targets of N
    positions, then c-row chunks of draft logits through the loss, forward and backward, as under
    checkpointing on CUDA), ct = TEACHER_CHUNK_ELEMS // V teacher rows, `mass` = the log-sum-exp is
    computed, `alpha_loss` = tv/nla/lk_hybrid in the mix.  Measured op by op on the meta device by
    bench/loss_memory.py (bench/results/loss_memory.json; tests/test_losses.py checks the bound):
      kept by the teacher   N (2 Vd + 8 + 4 mass)              bf16 logits, argmax, log-mass
                            + 4 N Vd if that is <= PROBS_CACHE_BYTES (the p^ cache)
      teacher's transient   ct (V (4 + 2 mass) + 4 Vd mass)    0 when Vd = V (one head matmul)
      one loss chunk        4 u c Vd + 2 Vd H                  u = 4 (ce, kl) or 6.5 (alpha losses);
                                                               2 Vd H: that chunk's lm_head gradient
      peak <= kept + max(teacher's transient, one loss chunk).
    Kimi-K2.5 (V = Vd = 163,840, H = 7168) at N = 8192: c = ct = 819, 2.5 GiB kept; bound 6.7 GiB
    for ce and 7.9 GiB for lk_hybrid (measured 5.1 and 5.9; the previous fp32 teacher: 15.1 GiB)."""
    full = V == Vd
    kept = N * (2 * Vd + 8 + 4 * mass) + (4 * N * Vd if 4 * N * Vd <= PROBS_CACHE_BYTES else 0)
    teacher = 0 if full else ct * (V * (4 + 2 * mass) + 4 * Vd * mass)
    loss = int(4 * (6.5 if alpha_loss else 4) * c * Vd) + 2 * Vd * H
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
# the chunk loss: value and hand-written gradient


class _ChunkLoss(torch.autograd.Function):
    """sum_i w_i * sum_k c_k * loss_k(p_i, softmax(z_i)), its gradient written out (see the module
    docstring).  Autograd's log_softmax -> mul -> sum would keep and re-read four [c, Vd] tensors
    per TTT step; this keeps the fp32 logits only and recomputes the rest in backward.  The teacher
    is saved by reference (no per-step copy of its rows).  Also returns the draft's argmax and,
    when asked, alpha and the target's probability of the draft's argmax per row (both detached)."""

    @staticmethod
    def forward(ctx, logits, t_logits, log_mass, rows, w, spec: LossSpec, softcap, want_alpha: bool, probs_cache):
        z = logits.to(torch.promote_types(logits.dtype, torch.float32))
        teacher = TeacherRows(t_logits, None, log_mass, softcap, probs_cache)
        lse = torch.logsumexp(z, dim=-1)
        ph = teacher.probs(rows).to(z.dtype)
        need_alpha = spec.needs_alpha or want_alpha
        per = {}
        if spec.weight("ce") or spec.weight("kl") or spec.weight("lk_hybrid"):
            per["ce"] = lse - torch.linalg.vecdot(z, ph)
        if spec.weight("kl") or spec.weight("lk_hybrid"):
            t = soft_cap(t_logits.index_select(0, rows).to(z.dtype), softcap)
            ent = torch.logsumexp(t, dim=-1) - torch.linalg.vecdot(t, ph)  # H(p^)
            per["kl"] = per["ce"] - ent
        alpha = pt_arg = None
        arg = z.max(dim=-1).indices
        if need_alpha:
            S = teacher.mass(rows).to(z.dtype)
            q = z.sub(lse[:, None]).exp_()
            alpha = torch.minimum(ph * S[:, None], q).sum(-1)
            pt_arg = ph.gather(1, arg[:, None])[:, 0] * S  # accepted with this probability when the draft proposes its argmax
            del q
        loss = None
        for name, c in spec.terms:
            if name == "ce":
                v = per["ce"]
            elif name == "kl":
                v = per["kl"]
            elif name == "tv":
                v = 1.0 - alpha
            elif name == "nla":
                v = -alpha.clamp_min(ALPHA_FLOOR).log()
            else:  # lk_hybrid
                lam = torch.exp(-spec.eta * alpha)
                v = lam * per["kl"] + (1.0 - lam) * (1.0 - alpha)
            v = v if c == 1.0 else c * v
            loss = v if loss is None else loss + v
        none = z.new_empty(0)
        ctx.save_for_backward(z, t_logits, none if log_mass is None else log_mass, rows, w, lse, none if probs_cache is None else probs_cache)
        ctx.spec, ctx.softcap, ctx.in_dtype = spec, softcap, logits.dtype
        if alpha is None:
            alpha, pt_arg = z.new_empty(0), z.new_empty(0)
        ctx.mark_non_differentiable(arg, alpha, pt_arg)
        return (loss * w.to(loss.dtype)).sum(), arg, alpha, pt_arg

    @staticmethod
    def backward(ctx, g, _g_arg, _g_alpha, _g_pt):
        z, t_logits, log_mass, rows, w, lse, probs_cache = ctx.saved_tensors
        spec = ctx.spec
        teacher = TeacherRows(t_logits, None, log_mass if log_mass.numel() else None, ctx.softcap,
                              probs_cache if probs_cache.numel() else None)
        ph = teacher.probs(rows).to(z.dtype)
        z = z.clone() if z.dtype == ctx.in_dtype else z  # z aliases the logits: do not overwrite them
        q = z.sub_(lse[:, None]).exp_()
        wg = w.to(z.dtype) * g
        if spec.terms == (("ce", 1.0),):  # the former SoftCrossEntropy's exact operations
            return q.sub_(ph).mul_(wg[:, None]).to(ctx.in_dtype), *[None] * 8
        # grad = c_kl (q - p^) + c_alpha dalpha/dz, dalpha/dz = q (m - A), m = [q < p], A = <m, q>, i.e.
        # q * (c_kl - c_alpha A + c_alpha m) - c_kl p^, with w g folded into the per-row coefficients
        c_kl = (spec.weight("ce") + spec.weight("kl")) * wg  # per row
        if not spec.needs_alpha:
            return q.sub_(ph).mul_(c_kl[:, None]).to(ctx.in_dtype), *[None] * 8
        p = ph * teacher.mass(rows).to(z.dtype)[:, None]
        alpha = torch.minimum(p, q).sum(-1)
        m = q < p
        del p
        mf = m.to(q.dtype)
        A = torch.linalg.vecdot(q, mf)
        c_alpha = torch.zeros_like(alpha)
        if spec.weight("tv"):
            c_alpha -= spec.weight("tv")
        if spec.weight("nla"):
            c_alpha -= spec.weight("nla") / alpha.clamp_min(ALPHA_FLOOR)
        if spec.weight("lk_hybrid"):
            lam = torch.exp(-spec.eta * alpha)  # sg(alpha): lambda is a constant of the gradient
            c_alpha -= spec.weight("lk_hybrid") * (1.0 - lam)
            c_kl = c_kl + spec.weight("lk_hybrid") * lam * wg
        c_alpha *= wg
        a = c_kl - c_alpha * A
        grad = mf.mul_(c_alpha[:, None]).add_(a[:, None]).mul_(q)
        if spec.weight("ce") or spec.weight("kl") or spec.weight("lk_hybrid"):
            grad.addcmul_(ph, c_kl[:, None], value=-1.0)
        return grad.to(ctx.in_dtype), *[None] * 8


def chunk_loss(logits: torch.Tensor, teacher: TeacherRows, rows: torch.Tensor, w: torch.Tensor, spec: LossSpec,
               want_alpha: bool = False):
    """One chunk: draft logits [c, Vd] against teacher rows `rows` ([c] indices into `teacher`),
    position weights w [c] -> (sum_i w_i loss_i (differentiable), draft argmax [c] (draft ids),
    alpha [c] or empty, p(draft argmax) [c] or empty).  alpha (= sum_v min(p_v, q_v), the acceptance
    probability of speculative sampling at temperature 1) and p(argmax) (the acceptance of a
    greedily drafted token under temperature-1 verification, SGLang's and vLLM's default) are
    computed when the loss needs them or `want_alpha` (the held-out evaluation)."""
    lm = teacher.log_mass
    if (spec.needs_alpha or want_alpha) and lm is None:
        teacher.mass(rows)  # the clear error
    return _ChunkLoss.apply(logits, teacher.logits, lm, rows, w, spec, teacher.softcap, want_alpha, teacher.probs_cache)
