"""Feature-store batches for training: a deterministic held-out split, length-bucketed padded
batches, and an epoch order that is a pure function of (seed, epoch) -- so the data position of
a run is just its step number, and resuming needs no iterator state."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

from eaglenest.capture.run import plan_batches
from eaglenest.features import FeatureStore
from eaglenest.train.compaction import bucketed


SPLIT_RULE = "prompt"  # what decides a sample's side: its normalized prompt's hash (data/prompts.py)


def held_out_mask(store, eval_fraction: float, tokenizer=None) -> torch.Tensor:
    """[N] bool: whether sample i (store order) is held out.  By content: the hash of its normalized
    prompt (data/prompts.py) below `eval_fraction`, so samples that share a prompt (a data set's
    duplicates, its copies with other spacing) are all on one side and the held-out statistics do
    not score answers the draft was trained on.  Reads every sample's ids (not its hidden states);
    nothing when eval_fraction is 0."""
    from eaglenest.data.prompts import key_fraction, prompt_ids, prompt_key

    held = torch.zeros(len(store), dtype=torch.bool)
    if eval_fraction <= 0:
        return held
    for i in range(len(store)):
        if hasattr(store, "sample"):  # online: the prepared sample (train/online.py OnlineData)
            s = store.sample(i)
            ids, mask = s.input_ids, s.loss_mask
        else:
            ids, mask = store.input_ids(i).tolist(), store.loss_mask(i).tolist()
        held[i] = key_fraction(prompt_key(prompt_ids(ids, mask), tokenizer)) < eval_fraction
    return held


def split(store: FeatureStore, eval_fraction: float, tokenizer=None, held: torch.Tensor | None = None) -> tuple[list[int], list[int]]:
    """(training, held-out) sample indices; `held` = held_out_mask's result when known (the trainer's
    rank 0 computes it and broadcasts it)."""
    held = held_out_mask(store, eval_fraction, tokenizer) if held is None else held
    train = [i for i in range(len(store)) if not held[i]]
    out = [i for i in range(len(store)) if held[i]]
    if not train:
        train, out = out, []
    return train, out


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
