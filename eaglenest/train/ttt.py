"""Training-time test (TTT): the EAGLE-3 loss over k unrolled draft steps.

Alignment (decided once, tested in tests/test_ttt.py against a slow reference):
  sequence x_0..x_{T-1}, aux features f_t, teacher distribution P_q from the target's final
  state at position q (it predicts x_{q+1}), loss mask m_q (1 on assistant tokens).
  Step j at index t: input token x_{t+1+j} (ground truth), hidden = fuse(f_t) for j = 0 else
  draft.feedback(the draft's own step-(j-1) output at index t) (the post-norm state with EAGLE 3.1's
  norm_output, exactly what the decoder and the engines feed back), rope position t+j; it predicts x_{t+2+j}, so
  teacher = P_{t+1+j} and the loss mask is the *predicted* token's m_{t+2+j}
  (we align the mask with the label instead of leaving it unshifted as SpecForge does: it trains
  exactly the predictions whose answer is an assistant token, none of the prompt's).
  Positions whose teacher argmax is outside the draft vocabulary get no loss (nothing to learn),
  but still count as misses in the accuracy (and in alpha, the acceptance at temperature 1).
  Attention at step j: causal over step-0 keys, plus key t of each earlier step (diagonal).
  Per-step loss = sum(weight * loss) / denominators[j], loss = `--loss` (losses.py: ce, kl, tv,
  nla, lk_hybrid or a weighted mix); total = sum_j step_decay^j * loss_j (`--step-decay`, 0.8).

Which rows each step computes is decided on the CPU from the loss mask (train/compaction.py): step
0 runs every row (its keys are the context of every later step), step j > 0 only the rows with a
loss at step j or later -- the same losses and gradients, without the prompt's rows.  The teacher's
draft-vocabulary logits are computed once per batch, at the positions some step reads (full-
vocabulary logits only chunk by chunk, for the argmax and the log-sum-exp); the rows with a loss of
every step then go through the fused draft head + loss (losses.head_loss) at once: gradients in
the forward, no [T, V] logits tensor kept or recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils.checkpoint import checkpoint

from eaglenest.draft.kernels import causal_kernel
from eaglenest.draft.model import Eagle3Draft
from eaglenest.models.target import final_norm, soft_cap
from eaglenest.train.compaction import RowPlan, bucketed, plan_rows
from eaglenest.train.losses import PROBS_CACHE_BYTES, LossSpec, SoftTarget, TeacherRows, head_loss, row_max


TEACHER_CHUNK_ELEMS = 1 << 27  # rows x full vocabulary of the teacher's transient logits (bf16: 256 MiB, its fp32 copy 512 MiB)


@dataclass
class Teacher:
    """The target's output head restricted to the draft vocabulary (frozen).

    The head's rows are held draft vocabulary first, then the other rows (`order`: the target id of
    each held row), so the full-vocabulary pass (the argmax, the log-sum-exp) computes only the rows
    the draft-vocabulary logits do not already give: each logit once, and no second copy of a head."""

    norm_weight: torch.Tensor | None  # applied iff the stored final state is pre-norm
    norm_eps: float
    lm_head: torch.Tensor  # [V, H] the target's whole head, given in target order, held draft rows first (`order`)
    draft_rows: torch.Tensor  # [Vd] target ids of the draft vocabulary
    t2d: torch.Tensor  # [V] bool
    matmul_dtype: torch.dtype = torch.float32  # bf16 on CUDA: fp32 matmuls would cost ~2x the draft's step
    logit_softcap: float | None = None  # the target's tanh logit cap (Gemma 2; models/families.py), None for most
    order: torch.Tensor | None = None  # [V] the target id of each held row (set on construction; None: a full-vocabulary draft, held as given)
    _w: dict = field(default_factory=dict, repr=False)  # the held head per matmul dtype

    def __post_init__(self):
        if self.order is None and not self.full_vocab:
            V, Vd = self.lm_head.shape[0], self.draft_rows.numel()
            others = torch.argsort(self.t2d.to(torch.int8), stable=True)[: V - Vd]  # ascending ids, no host sync (nonzero's)
            self.order = torch.cat([self.draft_rows, others]).to(self.lm_head.device)
            self.lm_head = self.lm_head.index_select(0, self.order)

    def to(self, device) -> "Teacher":
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return Teacher(mv(self.norm_weight), self.norm_eps, mv(self.lm_head), mv(self.draft_rows), mv(self.t2d), self.matmul_dtype,
                       self.logit_softcap, mv(self.order))

    @property
    def full_vocab(self) -> bool:
        """The draft vocabulary is the target's whole vocabulary in its order (Kimi-K2.5's published
        drafts): one head matmul gives the argmax too, and the mass inside is 1."""
        return self.draft_rows.numel() == self.lm_head.shape[0]  # draft ids are sorted by target id (draft/vocab.py)

    def heads(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the draft-vocabulary rows [Vd, H], the other rows [V - Vd, H]: empty for a full vocabulary),
        views of the head in the matmul dtype."""
        W = self._w.get(self.matmul_dtype)
        if W is None:
            W = self._w[self.matmul_dtype] = self.lm_head.to(self.matmul_dtype)
        Vd = self.draft_rows.numel()
        return W[:Vd], W[Vd:]

    @torch.no_grad()
    def targets(self, last_hidden: torch.Tensor, chunk: int | None = None, argmax: torch.Tensor | None = None,
                mass: bool = False, log_mass: torch.Tensor | None = None) -> TeacherRows:
        """last_hidden [N, H] -> TeacherRows: the draft-vocabulary logits [N, Vd] in the matmul dtype
        (probabilities are formed per loss chunk, losses.py), the target's argmax [N] and, with
        `mass`, log S [N] (S = the target's probability inside the draft vocabulary, from the
        full-vocabulary log-sum-exp).  Full-vocabulary logits exist one chunk of rows at a time.
        `argmax` / `log_mass` known from an earlier epoch skip the full-vocabulary head: on a small
        target it is most of the teacher's cost (SmolLM2: V = 6x the 8K draft vocabulary).

        Memory: see losses.loss_step_bytes (kept: N Vd b, b = 2 under bf16, + 12 N; + 4 N Vd for
        the p^ cache only while that is at most PROBS_CACHE_BYTES; transient: TEACHER_CHUNK_ELEMS // V
        rows of full-vocabulary logits).  Kimi-K2.5 (V = Vd = 163,840, bf16) at N = 8192: 2.5 GiB
        kept, ~0 transient (one head matmul), where the previous fp32 probabilities kept 5 GiB and
        its 8192-row chunks added 10 GiB (the retired probe loss_memory:
        git show afe579c:bench/results/loss_memory.json)."""
        Wd, Wc = self.heads()
        chunk = chunk or max(1, TEACHER_CHUNK_ELEMS // self.lm_head.shape[0])
        N, dev = last_hidden.shape[0], last_hidden.device
        full = self.full_vocab
        logits = torch.empty(N, Wd.shape[0], dtype=self.matmul_dtype, device=dev)
        arg = torch.empty(N, dtype=torch.long, device=dev) if argmax is None else argmax.to(dev)
        lm = None if not mass else (torch.zeros(N, device=dev) if full or log_mass is None else log_mass.to(dev))
        cache = None  # p^ once per micro-batch when small (TeacherRows.probs_cache)
        if N * Wd.shape[0] * 4 <= PROBS_CACHE_BYTES:
            cache = torch.empty(N, Wd.shape[0], dtype=torch.promote_types(self.matmul_dtype, torch.float32), device=dev)
        head_pass = not full and (argmax is None or (mass and log_mass is None))
        cap = self.logit_softcap
        for s in range(0, N, chunk):
            h = last_hidden[s : s + chunk].float()
            if self.norm_weight is not None:  # a pre-norm state (vLLM's): the target's own final norm first
                h = final_norm(h, self.norm_weight.float(), self.norm_eps)
            h = h.to(self.matmul_dtype)
            zd = logits[s : s + chunk]
            torch.matmul(h, Wd.T, out=zd)
            if cache is not None:
                cache[s : s + chunk] = torch.softmax(soft_cap(zd.to(cache.dtype), cap), dim=-1)
            if full and argmax is None:
                arg[s : s + chunk] = self.draft_rows[row_max(zd)[1]]
            if head_pass:  # the rows outside the draft vocabulary; the draft rows' logits are zd
                zc = h @ Wc.T
                if argmax is None:  # soft-capping is monotone: the argmax of the raw logits
                    md, i_d = row_max(zd)
                    mc, i_c = row_max(zc)
                    td, tc = self.draft_rows[i_d], self.order[Wd.shape[0] + i_c]
                    # the first maximum in target order, as torch's max over the whole row: a tie goes to the lower id
                    arg[s : s + chunk] = torch.where(mc > md, tc, torch.where(mc < md, td, torch.minimum(td, tc)))
                if mass and log_mass is None:  # log S = lse(draft rows) - lse(all rows), <= 0 up to rounding
                    lse_d = torch.logsumexp(soft_cap(zd.float(), cap), -1)
                    lse_c = torch.logsumexp(soft_cap(zc.float(), cap), -1)
                    del zc
                    lm[s : s + chunk] = (lse_d - torch.logaddexp(lse_d, lse_c)).clamp_max_(0.0)
        return TeacherRows(logits, arg, lm, cap, cache)


STAT_KEYS = ("loss_sum", "correct", "count", "loss_count")
ALPHA_KEYS = ("alpha_sum", "p_argmax_sum")  # over the counted tokens (metrics.summarize)


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """x[:, t] <- x[:, t+n] along dim 1, padding the end with `fill`."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)


def denominators(loss_mask: torch.Tensor, ttt: int) -> torch.Tensor:
    """Tokens that count for each step's loss normalizer (known before any forward)."""
    return torch.stack([shift_left(loss_mask, 2 + j).float().sum() for j in range(ttt)])


def ttt_forward(
    draft: Eagle3Draft,
    input_ids: torch.Tensor,  # [B, T] int64
    aux: torch.Tensor,  # [B, T, 3H]
    teacher: TeacherRows,  # the teacher's rows: all B*T positions (flattened), or with compact_teacher the plan's `teacher_rows`
    loss_mask: torch.Tensor,  # [B, T]
    ttt: int,
    denom: torch.Tensor,  # [ttt] normalizers (global over the optimizer step)
    step_decay: float = 0.8,
    chunk: int = 1024,
    attn_impl="eager",
    recompute: bool = False,
    loss: LossSpec = LossSpec(),
    want_alpha: bool = False,
    plan: RowPlan | None = None,
    compact_teacher: bool = False,
) -> tuple[torch.Tensor, dict]:
    """Returns (weighted total loss, stats with per-step loss sums, correct and counted tokens; with
    `want_alpha` or a loss that computes it, also the sums of alpha and of p(draft argmax), see
    losses.soft_rows, over the counted tokens).

    plan: which rows each step computes (train/compaction.py; default: built here from the mask,
    compacted); the loader builds it off the training thread.  compact_teacher: `teacher` holds only
    the plan's teacher_rows (what the trainer builds), not every position -- said, never inferred
    from its row count (a bucketed teacher_rows can be B*T rows long).  Step 0 runs whole sequences, step
    j > 0 only its plan's rows; the rows with a loss of every step then go through the draft head and
    the loss at once (losses.head_loss: gradients computed in the forward, no logits kept).
    attn_impl: "eager" (reference, materializes the scores), "chunked", "flex" or "sdpa", or a kernel
    object from eaglenest.draft.kernels.causal_kernel (the trainer keeps one: flex's compiled
    function and block masks live on it); recompute: run each draft step under activation
    checkpointing (keeps ~its inputs, K/V and output per step instead of every intermediate)."""
    B, T = input_ids.shape
    dev = input_ids.device
    kernel = causal_kernel(attn_impl) if isinstance(attn_impl, str) else attn_impl
    plan = (plan or plan_rows(loss_mask, ttt)).to(dev, non_blocking=True)
    want = plan.teacher_rows.numel() if compact_teacher else B * T
    if teacher.view_rows() != want:
        raise ValueError(f"teacher has {teacher.view_rows()} rows for a [{B}, {T}] batch (expected "
                         + (f"the plan's {want} teacher rows)" if compact_teacher else f"{want}: every position)"))
    trows = plan.teacher_index.index_select(0, plan.loss_teacher) if compact_teacher else plan.loss_teacher
    grad = torch.is_grad_enabled()

    def run(*args, **kw):
        if recompute and grad:
            return checkpoint(draft.ttt_step, *args, use_reentrant=False, **kw)
        return draft.ttt_step(*args, **kw)

    # step 0: whole sequences, causally; its keys are every later step's context (the layer's output only at plan.keep0)
    h, ctx_kv = run(shift_left(input_ids, 1), draft.fuse(aux), torch.arange(T, device=dev).expand(B, T), kernel=kernel, keep=plan.keep0)
    h = h.reshape(1, -1, h.shape[-1])  # [1, B*T or the kept rows, H]
    outs = [h[0].index_select(0, plan.loss0)]
    ids = torch.nn.functional.pad(input_ids.reshape(-1), (0, 1))  # flat, and a padding token at B*T
    diag = []
    for j, rows in enumerate(plan.steps, start=1):
        # step j: its rows read token x_{t+1+j} at position t+j and the state fed back from row t of step j-1
        fed = draft.feedback(h.index_select(1, rows.prev))
        h, kv = run(ids.index_select(0, rows.tok)[None], fed, (rows.idx % T + j)[None], ctx_kv=ctx_kv,
                    diag_kv=list(diag), kernel=kernel, rows=rows)
        diag.append(kv)
        outs.append(h[0].index_select(0, rows.loss))

    # the head and the loss of every step's rows with a loss, in one pass (rows rounded up to a bucket:
    # repeats of the last one, with no weight, cut off after)
    hs = torch.cat(outs)
    R = hs.shape[0]
    acc = torch.promote_types(hs.dtype, torch.float32)
    targ = teacher.argmax.index_select(0, trows)
    w = draft.t2d[targ].to(acc)  # no loss where the teacher's argmax is outside the draft vocabulary
    step_w = torch.tensor([step_decay**j for j in range(ttt)], dtype=acc, device=dev) / denom.to(dev, acc).clamp_min(1.0)
    coef = w * step_w.index_select(0, plan.step_of_loss)
    n = bucketed(R) - R
    if n and R:
        hs, trows_b, coef = torch.cat([hs, hs[-1:].expand(n, -1)]), torch.cat([trows, trows[-1:].expand(n)]), torch.cat([coef, coef.new_zeros(n)])
    else:
        trows_b = trows
    total, per_row, arg, alpha, p_arg = head_loss(draft.norm(hs), draft.lm_head.weight, SoftTarget(teacher, trows_b, loss), coef, chunk, want_alpha)
    per_row, arg, alpha, p_arg = per_row[:R], arg[:R], alpha[:R], p_arg[:R]
    cols = [per_row * w, (draft.to_target_ids(arg) == targ).to(per_row.dtype), w]
    alpha_stats = want_alpha or loss.needs_alpha
    if alpha_stats:
        cols += [alpha, p_arg]
    sums = torch.zeros(ttt, len(cols), dtype=torch.float64, device=dev).index_add_(0, plan.step_of_loss, torch.stack(cols, 1).double())
    vals = sums.tolist()  # the step's one host sync
    stats = {"loss_sum": [v[0] for v in vals], "correct": [v[1] for v in vals], "count": [float(c) for c in plan.counts],
             "loss_count": [v[2] for v in vals]}
    if alpha_stats:
        stats.update(alpha_sum=[v[3] for v in vals], p_argmax_sum=[v[4] for v in vals])
    return total, stats
