"""Feature-store batches for training: a deterministic held-out split, length-bucketed padded
batches, and an epoch order that is a pure function of (seed, epoch) -- so the data position of
a run is just its step number, and resuming needs no iterator state."""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Any

import torch

from eaglenest.capture.run import plan_batches
from eaglenest.features import FeatureStore
from eaglenest.train.compaction import bucketed


def is_held_out(sample_id: str, fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(sample_id.encode()).digest()[:8], "big")
    return (h / 2**64) < fraction


def split(store: FeatureStore, eval_fraction: float) -> tuple[list[int], list[int]]:
    train, held = [], []
    for i, sid in enumerate(store.ids()):
        (held if is_held_out(sid, eval_fraction) else train).append(i)
    if not train:
        train, held = held, []
    return train, held


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T]
    loss_mask: torch.Tensor  # [B, T]
    aux: torch.Tensor  # [B, T, 3H]
    last: torch.Tensor  # [B, T, H]
    n_tokens: int
    plan: Any = None  # the TTT steps' rows (train/compaction.py RowPlan), built by the loader; None: built when used

    def pin_memory(self) -> "Batch":
        """Page-locked copies, so the host-to-GPU copies can be asynchronous."""
        return Batch(*(t.pin_memory() for t in (self.input_ids, self.loss_mask, self.aux, self.last)), self.n_tokens,
                     None if self.plan is None else self.plan.map(torch.Tensor.pin_memory))


def collate(store: FeatureStore, idx: list[int], max_len: int | None = None) -> Batch:
    return collate_items([store[i] for i in idx], max_len)


def collate_items(items: list[dict], max_len: int | None = None) -> Batch:
    """Samples (input_ids, loss_mask, aux_hidden_states, last_hidden_state) -> one right-padded batch."""
    if max_len:
        items = [{k: (v[:max_len] if torch.is_tensor(v) else v) for k, v in it.items()} for it in items]
    # right-padded to whole row buckets: the step's matmuls then see few distinct shapes (train/compaction.py)
    T = bucketed(max(it["input_ids"].shape[0] for it in items))
    B = len(items)
    H3 = items[0]["aux_hidden_states"].shape[1]
    H = items[0]["last_hidden_state"].shape[1]
    ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.long)
    aux = torch.zeros(B, T, H3, dtype=items[0]["aux_hidden_states"].dtype)
    last = torch.zeros(B, T, H, dtype=items[0]["last_hidden_state"].dtype)
    n = 0
    for b, it in enumerate(items):
        t = it["input_ids"].shape[0]
        n += t
        ids[b, :t] = it["input_ids"]
        mask[b, :t] = it["loss_mask"]
        aux[b, :t] = it["aux_hidden_states"]
        last[b, :t] = it["last_hidden_state"]
    return Batch(ids, mask, aux, last, n)


class Schedule:
    """Micro-batches per epoch and their order; step s of the run uses micro-batches
    [s*grad_accum, (s+1)*grad_accum) of the concatenated epoch orders."""

    def __init__(self, lengths: list[int], indices: list[int], batch_tokens: int, grad_accum: int, seed: int, max_len: int):
        lens = [min(lengths[i], max_len) for i in indices]
        self.batches = [[indices[j] for j in b] for b in plan_batches(lens, batch_tokens)]
        self.grad_accum = grad_accum
        self.seed = seed

    @property
    def steps_per_epoch(self) -> int:
        return max(1, len(self.batches) // self.grad_accum)

    def epoch_order(self, epoch: int) -> list[list[int]]:
        order = list(range(len(self.batches)))
        random.Random(self.seed * 100003 + epoch).shuffle(order)
        return [self.batches[i] for i in order]

    def step_batches(self, step: int) -> tuple[int, list[list[int]]]:
        """(epoch, the micro-batches of this optimizer step); a partial tail of an epoch is dropped."""
        epoch, k = divmod(step, self.steps_per_epoch)
        order = self.epoch_order(epoch)
        return epoch, order[k * self.grad_accum : (k + 1) * self.grad_accum]
