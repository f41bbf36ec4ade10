"""The reduced draft vocabulary: the K most frequent tokens under the loss mask.

`d2t[i]` is an int64 offset: draft id i means target id i + d2t[i]; `t2d[v]` is True iff target
id v is in the draft vocabulary.  Draft ids are sorted by target id (so d2t is non-decreasing).
"""

from __future__ import annotations

import torch

from eaglenest import EaglenestError


def build_vocab(counts: torch.Tensor, k: int, always: list[int] | None = None,
                filler_excluded: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """counts [V] token frequencies -> (d2t [K] int64, t2d [V] bool).

    The K most frequent tokens, ties broken by lower id first; `always` ids (e.g. end-of-turn/eos)
    are included even when rare.  When fewer than K tokens occur, the rest ("filler") are never-seen
    tokens, lowest id first -- except `filler_excluded` ids (special tokens, ids no text produces:
    setup.draft_vocab), which come only after every other never-seen token: a filler slot is one the
    draft should learn to leave alone, and a special token's target-initialized row starts loud.
    """
    V = counts.numel()
    k = min(int(k), V)
    if k <= 0:
        raise EaglenestError(f"draft vocabulary size must be positive (got {k})")
    counts = counts.to(torch.float64).clone()
    excl = torch.tensor([t for t in filler_excluded or [] if 0 <= t < V], dtype=torch.long)
    if excl.numel():
        counts[excl] = torch.where(counts[excl] > 0, counts[excl], -1.0)  # seen ones keep their count
    for t in always or []:
        if 0 <= t < V:
            counts[t] = float("inf")
    # stable sort on (-count, id): argsort of -count is stable with stable=True
    order = torch.sort(-counts, stable=True).indices[:k]
    chosen = torch.sort(order).values
    d2t = (chosen - torch.arange(k)).to(torch.int64)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[chosen] = True
    return d2t, t2d


def draft_ids_to_target(d2t: torch.Tensor) -> torch.Tensor:
    return torch.arange(d2t.numel(), device=d2t.device) + d2t


def target_to_draft_index(t2d: torch.Tensor) -> torch.Tensor:
    """[V] int64: draft id of each target id, -1 where the token is not in the draft vocab."""
    idx = torch.full((t2d.numel(),), -1, dtype=torch.int64, device=t2d.device)
    pos = t2d.nonzero(as_tuple=True)[0]
    idx[pos] = torch.arange(pos.numel(), device=t2d.device)
    return idx


def check_vocab(d2t: torch.Tensor, t2d: torch.Tensor) -> str | None:
    """Why a (d2t, t2d) pair is inconsistent, or None."""
    tgt = draft_ids_to_target(d2t)
    V = t2d.numel()
    if d2t.dtype != torch.int64:
        return f"d2t must be int64 (is {d2t.dtype})"
    if (tgt < 0).any() or (tgt >= V).any():
        return "d2t maps a draft id outside the target vocabulary"
    if (tgt[1:] <= tgt[:-1]).any():
        return "d2t target ids are not strictly increasing (duplicates or unsorted)"
    if int(t2d.sum()) != d2t.numel():
        return f"t2d marks {int(t2d.sum())} tokens but the draft vocabulary has {d2t.numel()}"
    if not t2d[tgt].all():
        return "t2d does not mark every target id that d2t maps to"
    return None
