"""Row compaction: which rows each training-time-test step computes, decided on the CPU from the loss mask.

Row t of step j (sample b) reads token x_{t+1+j} and predicts x_{t+2+j}: it has a loss iff m_{t+2+j}
(train/ttt.py).  Its output reaches a later step i only through row t itself (the hidden state fed
back, the diagonal key t), and step i > 0 attends to step 0's keys -- never to another row of a
step j > 0.  So step 0 computes every row's keys and values (every later row's context), but the
rest of its layer (o_proj, the residual, the MLP) only for the rows with a loss at some step
(`keep0`), and step j > 0 only the rows with a loss at step j or later: the same losses, gradients
and statistics as computing every row, with the rows that carry nothing (the prompt, padding, the
tail) skipped.

Steps j > 0 hold their rows flat ([1, N_j, ..]): every row-wise op (the projections, the MLP, the
norms) runs on N_j rows.  Their attention runs in the sequences' own [B, T] layout (`StepRows.
padded`: the rows scattered back to their positions, zeros elsewhere) with the causal kernel as
step 0's, and its output is read back at the rows: a query sees exactly what it sees uncompacted.

Row counts are rounded up to whole ROW_BUCKET rows by repeating a step's last row (a repeat's output
goes nowhere: no loss, no later step, no key), so the matmuls see a few distinct shapes: oneDNN
builds a kernel per new shape on the CPU (~5 ms each), which per-batch row counts would pay on every
step.  Everything here is index arithmetic on the CPU (built by the loader, off the training thread):
the step itself needs no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

ROW_BUCKET = 64


def bucketed(n: int) -> int:
    return -(-n // ROW_BUCKET) * ROW_BUCKET if n else 0


def _pad_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [k] padded to n entries by repeating its last one."""
    return x if x.numel() >= n else torch.cat([x, x[-1:].expand(n - x.numel())])


@dataclass
class StepRows:
    """The rows of one step j > 0 (flat ids b*T + t, ascending, then repeats of the last) and their places."""

    idx: torch.Tensor  # [N] flat row ids
    tok: torch.Tensor  # [N] flat id of the token each row reads (x_{t+1+j}; B*T: past its sample's end, reads padding)
    prev: torch.Tensor  # [N] position of each row among step j-1's rows
    loss: torch.Tensor  # [L] positions among this step's rows of those with a loss at step j
    slots: torch.Tensor  # [B*T] position among this step's rows of each sequence position (N: not computed)

    def padded(self, x: torch.Tensor, B: int) -> torch.Tensor:
        """x [1, .., N, d] (rows on dim -2) -> [B, .., T, d]: each row at its position, zeros elsewhere."""
        z = torch.cat([x, x.new_zeros(*x.shape[:-2], 1, x.shape[-1])], dim=-2)
        return z.index_select(-2, self.slots).unflatten(-2, (B, -1)).movedim(-3, 0).squeeze(1)

    def unpadded(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, .., T, d] -> [1, .., N, d]: the values at this step's rows."""
        return x.movedim(0, -3).flatten(-3, -2).index_select(-2, self.idx).unsqueeze(0)

    @property
    def rows(self) -> int:
        return self.idx.numel()


@dataclass
class RowPlan:
    B: int
    T: int
    keep0: torch.Tensor | None  # [N0] flat ids of the rows whose step-0 output is read (bucketed); None: every row
    loss0: torch.Tensor  # [L0] positions among step 0's output rows of those with a loss
    steps: list[StepRows]  # steps 1..ttt-1 (fewer when a step has no row left: later ones have none either)
    teacher_rows: torch.Tensor  # [Q] flat ids q whose teacher distribution P_q some step reads (m_{q+1} = 1), bucketed
    teacher_index: torch.Tensor  # [B*T] position of flat id q among teacher_rows (-1: not read)
    step_of_loss: torch.Tensor  # [sum_j L_j] the step of each loss row, in step order (for per-step sums)
    loss_teacher: torch.Tensor  # [sum_j L_j] flat teacher id (b*T + t+1+j) of each loss row, in step order
    counts: list[int]  # L_j per step (the accuracy's denominator: every row whose predicted token is the answer's)

    def map(self, fn) -> "RowPlan":
        """The plan with `fn` applied to every tensor (a device move, pinning)."""
        steps = [StepRows(*(fn(getattr(s, f.name)) for f in fields(StepRows))) for s in self.steps]
        return RowPlan(self.B, self.T, None if self.keep0 is None else fn(self.keep0), fn(self.loss0), steps, fn(self.teacher_rows), fn(self.teacher_index),
                       fn(self.step_of_loss), fn(self.loss_teacher), self.counts)

    def to(self, device, non_blocking: bool = False) -> "RowPlan":
        return self.map(lambda t: t.to(device, non_blocking=non_blocking))

    @property
    def rows_computed(self) -> int:
        """Rows the layer runs over all steps (B*T for step 0)."""
        return self.B * self.T + sum(s.rows for s in self.steps)


def _shifted(mask: torch.Tensor, n: int) -> torch.Tensor:
    """m[:, t] <- mask[:, t+n] > 0 (False past the end)."""
    out = torch.zeros_like(mask, dtype=torch.bool)
    if n < mask.shape[1]:
        out[:, : mask.shape[1] - n] = mask[:, n:] > 0
    return out


def plan_rows(loss_mask: torch.Tensor, ttt: int, compact: bool = True) -> RowPlan:
    """The RowPlan of a [B, T] loss mask over `ttt` steps.  compact=False keeps every row at every step
    (the reference the compacted plan must equal)."""
    mask = loss_mask.detach().cpu()
    B, T = mask.shape
    ar = torch.arange(B * T)
    has = [_shifted(mask, 2 + j).reshape(-1) for j in range(ttt)]  # loss at step j, per flat row
    later = torch.zeros(B * T, dtype=torch.bool)
    keep = [None] * ttt
    for j in range(ttt - 1, 0, -1):
        later = later | has[j]
        keep[j] = later.clone() if compact else torch.ones(B * T, dtype=torch.bool)
    real0 = ar[has[0] | later] if compact else ar  # step 0's output rows: a loss at some step (`later`: at step 1 on)
    keep0 = None
    pos_prev = ar  # step 0: every row, in flat order
    if 0 < real0.numel() and bucketed(real0.numel()) < B * T:
        keep0 = _pad_rows(real0, bucketed(real0.numel()))
        pos_prev = torch.full((B * T,), keep0.numel(), dtype=torch.long)
        pos_prev[real0] = torch.arange(real0.numel())
    loss0 = pos_prev[ar[has[0]]]
    steps, loss_ids, step_ids = [], [ar[has[0]]], [torch.zeros(int(has[0].sum()), dtype=torch.long)]
    for j in range(1, ttt):
        real = ar[keep[j]]
        if real.numel() == 0:
            break
        idx = _pad_rows(real, bucketed(real.numel()))
        pos = torch.full((B * T,), idx.numel(), dtype=torch.long)  # N (a zero row in `padded`): not computed
        pos[real] = torch.arange(real.numel())
        lid = ar[has[j]]
        loss_ids.append(lid)
        step_ids.append(torch.full((lid.numel(),), j, dtype=torch.long))
        tok = torch.where(idx % T + 1 + j < T, idx + 1 + j, B * T)  # only the uncompacted reference reads past the end
        steps.append(StepRows(idx, tok, pos_prev[idx], pos[lid], pos))
        pos_prev = pos
    q = ar[_shifted(mask, 1).reshape(-1)]
    teacher_index = torch.full((B * T,), -1, dtype=torch.long)
    teacher_index[q] = torch.arange(q.numel())
    loss_teacher = torch.cat([lid + 1 + j for j, lid in enumerate(loss_ids)])
    return RowPlan(B, T, keep0, loss0, steps, _pad_rows(q, bucketed(q.numel())), teacher_index, torch.cat(step_ids), loss_teacher,
                   [int(x.numel()) for x in loss_ids] + [0] * (ttt - len(loss_ids)))
