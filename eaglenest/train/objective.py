"""What a training step minimizes, per draft kind, behind one small interface the trainer calls.

An objective turns a micro-batch (train/data.py `Batch`) into a loss and per-position statistics:

    positions                               how many per-position stats it reports (P)
    denominators(batch, step) -> [D]        the micro-batch's loss normalizers, known before any
                                            forward; the trainer sums them over the optimizer
                                            step's micro-batches and ranks (so N ranks == 1)
    forward(model, batch, key, denom, step) -> (loss, stats, tokens)
        stats = {"loss_sum", "correct", "count", "loss_count"[, "alpha_sum", "p_argmax_sum"]}: lists
        of P floats, summed by the trainer and turned into loss/acc/expected_tau (and the acceptance
        at temperature 1) per position by metrics.summarize.

  * `Eagle3Objective`: training-time test (train/ttt.py) over `ttt_steps` draft steps against the
    target's distribution (the teacher head over the stored final state) under --loss; P = ttt_steps.
  * `DFlashObjective`: random anchor blocks, hard-label cross-entropy on the block's tokens
    (optionally decayed by position) or D-PACE weights; P = block_size - 1.  Its `correct`/`count`
    are *prefix* counts, so acc[k] is the acceptance at block slot k+1 given slots 1..k were
    accepted, and summarize's expected_tau is the greedy acceptance length the blocks imply.
`step` seeds what an objective samples (DFlash's anchors), so a resumed run replays it exactly.
"""

from __future__ import annotations

import hashlib

import torch

from eaglenest import EaglenestError
from eaglenest.draft.vocab import target_to_draft_index
from eaglenest.train.data import Batch
from eaglenest.train.compaction import plan_rows
from eaglenest.train.losses import HardTarget, LossSpec, chunk_rows, head_loss
from eaglenest.train.ttt import STAT_KEYS, TeacherRows, ttt_forward
from eaglenest.train.ttt import denominators as ttt_denominators


class Eagle3Objective:
    """EAGLE-3's training-time test: `ttt_steps` unrolled steps (train/ttt.py) against the target's
    distribution (the teacher over the stored final state) under the run's loss (train/losses.py:
    ce, kl, tv, nla, lk_hybrid or a mix), each step weighted step_decay^j."""

    def __init__(self, teacher, ttt_steps: int, *, device: str, autocast: bool, attn, logits_chunk: int,
                 recompute, argmax_room: int, loss: LossSpec = LossSpec(), step_decay: float = 0.8):
        self.teacher, self.positions = teacher, ttt_steps
        self.device, self.autocast, self.attn, self.logits_chunk, self.recompute = device, autocast, attn, logits_chunk, recompute
        self.loss, self.step_decay = loss, step_decay
        self.device_type = "cuda" if device.startswith("cuda") else "cpu"
        # micro-batch -> the target's argmax (int32) and, when computed, log-mass (fp32) per position
        # (host RAM), reused by later epochs (and evaluations); at most `argmax_room` tokens
        self._argmax: dict[tuple, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._argmax_room = argmax_room

    @property
    def needs_alpha(self) -> bool:
        return self.loss.needs_alpha

    def denominators(self, b: Batch, step: int | None = None) -> torch.Tensor:
        return ttt_denominators(b.loss_mask, self.positions)

    def _teacher(self, last: torch.Tensor, rows: torch.Tensor, key: tuple | None, mass: bool) -> TeacherRows:
        """The teacher's rows for one micro-batch: only the positions some TTT step reads (`rows`, the
        plan's teacher_rows: those followed by an answer token).  Micro-batches keep their samples
        every epoch: the target's argmax (and log-mass, when a loss or the evaluation needs alpha) are
        computed once per batch and cached, so later epochs skip the full-vocabulary head."""
        known = self._argmax.get(key)
        arg, lm = (None, None) if known is None else known
        t = self.teacher.targets(last.reshape(-1, last.shape[-1]).index_select(0, rows), argmax=None if arg is None else arg.long(),
                                 mass=mass, log_mass=lm)
        new = known is None or (mass and lm is None)
        if new and key is not None and (known is not None or t.argmax.numel() <= self._argmax_room):
            if known is None:
                self._argmax_room -= t.argmax.numel()
            self._argmax[key] = (t.argmax.to("cpu", torch.int32), None if t.log_mass is None else t.log_mass.cpu())
        return t

    def forward(self, model, b: Batch, key: tuple | None, denom: torch.Tensor, step: int | None = None,
                want_alpha: bool = False):
        dev = self.device
        nb = self.device_type == "cuda"  # pinned by the loader: the copies overlap
        plan = (b.plan if b.plan is not None and len(b.plan.counts) == self.positions else plan_rows(b.loss_mask, self.positions))
        plan = plan.to(dev, non_blocking=nb)
        teacher = self._teacher(b.last.to(dev, non_blocking=nb), plan.teacher_rows, key, mass=want_alpha or self.loss.needs_alpha)
        B, T = b.input_ids.shape
        cuda = self.device_type == "cuda"
        with torch.autocast(self.device_type, dtype=torch.bfloat16, enabled=self.autocast):
            loss, stats = ttt_forward(
                model,
                b.input_ids.to(dev, non_blocking=nb),
                b.aux.to(dev, non_blocking=nb).to(torch.bfloat16 if self.autocast else torch.float32),
                teacher,
                b.loss_mask.to(dev, non_blocking=nb),
                self.positions,
                denom.to(dev),
                step_decay=self.step_decay,
                chunk=chunk_rows(self.logits_chunk or (4096 if cuda else 1024), model.cfg.draft_vocab_size),
                attn_impl=self.attn,
                recompute=self.recompute(B * T),
                loss=self.loss,
                want_alpha=want_alpha,
                plan=plan,
                compact_teacher=True,
            )
        return loss, stats, b.n_tokens


# --- DFlash --------------------------------------------------------------------------------------
def paper_decay(block_size: int) -> float:
    """The position-decay gamma the DFlash recipe uses per block size (7 for 16, 5 for 10, 4 for 8;
    about (block_size - 1) / 2 in between): weight of block slot k = exp(-(k - 1) / gamma)."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, (block_size - 1) / 2))


def row_seed(base: int, step: int | None, ids: torch.Tensor) -> int:
    """A sample's anchor seed: a function of the run seed, the step and the sample's tokens, so the
    same anchors are drawn whichever rank or micro-batch the sample lands in, and on a resume."""
    h = hashlib.sha256(f"{base}:{'eval' if step is None else step}:".encode())
    h.update(ids.to(torch.int64).cpu().numpy().tobytes())
    return int.from_bytes(h.digest()[:8], "little") & ((1 << 63) - 1)


def sample_anchors(b: Batch, n_anchors: int, seed: int, step: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `n_anchors` anchor positions per sample, uniformly without replacement among the
    positions a whose token and next token are both under the loss mask (an assistant token whose
    block drafts assistant tokens: at decoding, the anchor is always a generated token), sorted.
    -> (anchors [B, N] long, keep [B, N] bool); N = the batch's largest count (0 possible)."""
    B = b.input_ids.shape[0]
    mask = b.loss_mask > 0
    rows = []
    for i in range(B):
        ok = (mask[i, :-1] & mask[i, 1:]).nonzero(as_tuple=True)[0]
        if ok.numel() > n_anchors:
            end = int(mask[i].nonzero()[-1]) + 1  # the seed ignores padding (its length depends on the batch)
            g = torch.Generator().manual_seed(row_seed(seed, step, b.input_ids[i, :end]))
            ok = ok[torch.randperm(ok.numel(), generator=g)[:n_anchors]].sort().values
        rows.append(ok)
    N = max((r.numel() for r in rows), default=0)
    anchors = torch.zeros(B, N, dtype=torch.long)
    keep = torch.zeros(B, N, dtype=torch.bool)
    for i, r in enumerate(rows):
        anchors[i, : r.numel()] = r
        keep[i, : r.numel()] = True
    return anchors, keep


class DFlashObjective:
    """DFlash's block objective.  For each anchor a: the draft sees the context before a and the
    block [x_a, MASK ...]; slot k (1..S-1) is trained to say x_{a+k} with a hard label, where that
    token is under the loss mask (and in the draft vocabulary: others are misses with no loss).

    loss "ce":    sum over slots of w_k CE / (the step's sum of w_k),  w_k = exp(-(k-1)/gamma)
                  (gamma 0: w = 1);
    loss "dpace": D-PACE (arXiv 2605.18810): the gradient of the block's expected accepted length.
                  With q_k the draft's probability of the label and s_k = (1-alpha) q_k + alpha, slot k
                  weighs sum_{j >= k} prod_{i <= j} s_i (over valid slots; detached), divided by the
                  step's number of blocks.  (SpecForge's "dpace" loss; alpha smooths early training.)"""

    def __init__(self, block_size: int, n_anchors: int, *, seed: int, device: str, autocast: bool, decay: float | None,
                 loss: str = "ce", dpace_alpha: float = 0.5, logits_chunk: int = 0):
        if loss not in ("ce", "dpace"):
            raise EaglenestError(f"--dflash-loss must be ce or dpace (got {loss})")
        if n_anchors < 1:
            raise EaglenestError(f"--dflash-anchors must be at least 1 (got {n_anchors})")
        if not 0.0 <= dpace_alpha <= 1.0:
            raise EaglenestError(f"--dpace-alpha must be in [0, 1] (got {dpace_alpha})")
        self.S, self.n_anchors, self.seed = block_size, n_anchors, seed
        self.positions = block_size - 1
        self.device, self.autocast, self.loss, self.alpha = device, autocast, loss, dpace_alpha
        self.device_type = "cuda" if device.startswith("cuda") else "cpu"
        self.gamma = paper_decay(block_size) if decay is None else float(decay)
        self.logits_chunk = logits_chunk

    # --- the plan: anchors, labels, weights (no model) ------------------------------------
    def plan(self, b: Batch, t2d: torch.Tensor, step: int | None) -> dict:
        anchors, keep = sample_anchors(b, self.n_anchors, self.seed, step)
        B, T = b.input_ids.shape
        k = torch.arange(1, self.S)
        lpos = anchors[..., None] + k  # [B, N, S-1]: the labelled positions
        inr = (lpos < T) & keep[..., None]  # padding has loss mask 0, so `valid` also stops at each sample's end
        lc = lpos.clamp(max=T - 1).reshape(B, -1)
        labels = b.input_ids.gather(1, lc).view_as(lpos)
        valid = inr & (b.loss_mask.gather(1, lc).view_as(lpos) > 0)
        in_draft = t2d.cpu()[labels] & valid
        decay = torch.exp(-(k - 1).double() / self.gamma) if self.gamma > 0 else torch.ones(self.S - 1, dtype=torch.float64)
        return {"anchors": anchors, "keep": keep, "labels": labels, "valid": valid, "in_draft": in_draft, "decay": decay}

    def denominators(self, b: Batch, step: int | None = None, t2d: torch.Tensor | None = None) -> torch.Tensor:
        p = self.plan(b, self._t2d if t2d is None else t2d, step)
        return torch.stack([(p["in_draft"].double() * p["decay"]).sum(), p["valid"].any(-1).sum().double()])

    def bind(self, t2d: torch.Tensor) -> "DFlashObjective":
        """The draft vocabulary the denominators need (known once the model exists)."""
        self._t2d = t2d.detach().cpu()
        return self

    # --- the forward ------------------------------------------------------------------------
    needs_alpha = False  # hard labels: no acceptance-probability statistics

    def forward(self, model, b: Batch, key: tuple | None, denom: torch.Tensor, step: int | None = None,
                want_alpha: bool = False):
        """`want_alpha` is accepted for the trainer's one call and ignored: DFlash trains on hard labels
        (its held-out statistics are the greedy prefix acceptance per block slot)."""
        p = self.plan(b, model.t2d, step)
        dev, nb = self.device, self.device_type == "cuda"
        B, N = p["anchors"].shape
        stats = {k: [0.0] * self.positions for k in STAT_KEYS}
        if N == 0:  # no sample of the micro-batch has an assistant token followed by another
            return next(model.parameters()).sum() * 0.0, stats, b.n_tokens
        anchors = p["anchors"].to(dev)
        with torch.autocast(self.device_type, dtype=torch.bfloat16, enabled=self.autocast):
            aux = b.aux.to(dev, non_blocking=nb).to(torch.bfloat16 if self.autocast else model.fc.weight.dtype)
            T = aux.shape[1]
            kv = model.context_kv(model.fuse(aux), torch.arange(T, device=dev).expand(B, T))
            ids = b.input_ids.to(dev, non_blocking=nb)
            bpos = anchors[..., None] + torch.arange(self.S, device=dev)
            h = model.blocks(model.block_input(ids.gather(1, anchors)), bpos, kv, anchors)[:, :, 1:]  # [B, N, S-1, H]
            rows = p["in_draft"].reshape(-1).nonzero(as_tuple=True)[0].to(dev)  # only slots with a loss
            labels = p["labels"].to(dev).reshape(-1).index_select(0, rows)
            target = HardTarget(target_to_draft_index(model.t2d)[labels])
            hn = model.norm(h.reshape(-1, h.shape[-1]).index_select(0, rows))
            chunk = chunk_rows(self.logits_chunk or (4096 if self.device_type == "cuda" else 1024), model.cfg.draft_vocab_size)
            ind, valid = p["in_draft"].to(dev), p["valid"].to(dev)
            if self.loss == "ce":
                coef = (p["decay"].to(dev) * ind).reshape(-1).index_select(0, rows) / denom[0].to(dev).clamp_min(1.0)
            else:  # D-PACE weighs a slot by the draft's own (detached) probabilities of the block's labels: one head pass without gradients first
                with torch.no_grad():
                    ce0 = head_loss(hn, model.lm_head.weight, target, hn.new_zeros(rows.numel(), dtype=torch.float32), chunk)[1]
                q = torch.zeros(B * N * (self.S - 1), dtype=ce0.dtype, device=dev).index_put((rows,), (-ce0).exp())
                coef = dpace_weights(q.view(B, N, -1), valid, self.alpha).reshape(-1).index_select(0, rows) / denom[1].to(dev).clamp_min(1.0)
            loss, ce, arg, _, _ = head_loss(hn, model.lm_head.weight, target, coef, chunk)
        # per-slot bookkeeping on [B, N, S-1] grids
        ce_grid = torch.zeros(B * N * (self.S - 1), dtype=ce.dtype, device=dev).index_put((rows,), ce).view(B, N, -1)
        hit = torch.zeros(B * N * (self.S - 1), dtype=torch.bool, device=dev)
        hit[rows] = model.to_target_ids(arg) == labels
        hit = hit.view(B, N, -1)
        prefix_ok = hit.long().cumprod(-1).bool()  # slots 1..k all accepted
        reached = valid & torch.cat([p["keep"].to(dev)[..., None], prefix_ok[..., :-1]], -1)
        cols = lambda x: x.double().sum((0, 1)).tolist()  # noqa: E731 -- per-slot sums, one sync each
        stats = {"loss_sum": cols(ce_grid * ind), "correct": cols(prefix_ok & reached), "count": cols(reached),
                 "loss_count": cols(ind)}
        return loss, stats, b.n_tokens


def dpace_weights(q: torch.Tensor, valid: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE slot weights [.., S-1] (detached): with s_k = (1 - alpha) q_k + alpha on valid slots
    (1 elsewhere: a no-op in the products), weight_k = sum_{j >= k, valid} prod_{i <= j} s_i -- the
    derivative of E[accepted] = sum_j prod_{i <= j} q_i with respect to log q_k, smoothed."""
    s = torch.where(valid, (1.0 - alpha) * q + alpha, torch.ones_like(q))
    prefix = torch.cumprod(s, -1) * valid
    return prefix.flip(-1).cumsum(-1).flip(-1).detach()


def make_objective(cfg, dcfg, *, teacher, device: str, autocast: bool, attn, recompute, argmax_room: int):
    """The objective of the draft's kind, from the run's TrainConfig and DraftConfig."""
    if dcfg.kind == "dflash":
        return DFlashObjective(dcfg.block_size, cfg.dflash_anchors, seed=cfg.seed, device=device, autocast=autocast,
                               decay=cfg.dflash_decay, loss=cfg.dflash_loss, dpace_alpha=cfg.dpace_alpha,
                               logits_chunk=cfg.logits_chunk)
    return Eagle3Objective(teacher, cfg.ttt_steps, device=device, autocast=autocast, attn=attn, logits_chunk=cfg.logits_chunk,
                           recompute=recompute, argmax_room=argmax_room, loss=cfg.loss_spec(), step_decay=cfg.step_decay)

