"""The trainer's one data path: a *source* turns an optimizer step number into this rank's
collated micro-batches (`StepData`), and a `Prefetcher` runs the source ahead of the loop.

The data order is a pure function of (seed, step) (see data.py), so a source needs no iterator
state and a resumed run asks for the same steps again.  `StoreSource` reads a feature store;
another source (e.g. batches captured online by an engine) plugs in beside it by implementing
`load(step) -> StepData` and `load_batch(idx) -> Batch`; the loop does not change.

Under torchrun each rank's source reads only its own micro-batches (every world-th of the step,
starting at its rank); the loss normalizers are summed over ranks by the trainer, not read.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from eaglenest.features import FeatureStore
from eaglenest.train.data import Batch, Schedule, collate
from eaglenest.train.ttt import denominators


@dataclass
class StepData:
    step: int
    epoch: int
    batches: list[Batch]  # this rank's micro-batches of the step, collated
    keys: list[tuple[int, ...]]  # their sample indices (the teacher-argmax cache key)
    denom: torch.Tensor  # [ttt] this rank's share of the step's loss normalizers

    @property
    def n_tokens(self) -> int:
        return sum(b.n_tokens for b in self.batches)


class StoreSource:
    """Micro-batches of a step read from a feature store: this rank's share only."""

    def __init__(self, store: FeatureStore, schedule: Schedule, ttt: int, max_len: int, rank: int = 0, world: int = 1, pin: bool = False):
        self.store, self.schedule, self.ttt, self.max_len = store, schedule, ttt, max_len
        self.rank, self.world, self.pin = rank, world, pin

    def micro_batches(self, step: int) -> tuple[int, list[list[int]]]:
        """(epoch, the sample indices of this rank's micro-batches of `step`)."""
        epoch, batches = self.schedule.step_batches(step)
        return epoch, [b for k, b in enumerate(batches) if k % self.world == self.rank]

    def load_batch(self, idx: list[int]) -> Batch:
        b = collate(self.store, idx, self.max_len)
        return b.pin_memory() if self.pin else b

    def load(self, step: int) -> StepData:
        epoch, mine = self.micro_batches(step)
        batches = [self.load_batch(idx) for idx in mine]
        denom = torch.zeros(self.ttt)
        for b in batches:
            denom += denominators(b.loss_mask, self.ttt)
        return StepData(step, epoch, batches, [tuple(i) for i in mine], denom)


class Prefetcher:
    """Loads steps [s, s + depth] in `threads` background threads while the loop computes step s
    (bounded: at most depth + 1 steps of batches exist at once).  Steps are handed out in order;
    depth 0 loads in the caller's thread.  Reading is I/O and collation is torch copies, which
    release the GIL, so one thread overlaps the step's compute."""

    def __init__(self, source, depth: int = 2, threads: int = 1, end: int | None = None):
        self.source, self.depth, self.end = source, depth, end
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="eaglenest-loader") if depth > 0 else None
        self.pending: dict[int, Future] = {}
        self.lock = threading.Lock()

    def get(self, step: int) -> StepData:
        if self.pool is None:
            return self.source.load(step)
        with self.lock:
            for s in list(self.pending):  # a jump (e.g. a resumed run): drop what will not be asked for
                if s < step:
                    self.pending.pop(s).cancel()
            last = step + self.depth if self.end is None else min(step + self.depth, self.end - 1)
            for s in range(step, last + 1):
                if s not in self.pending:
                    self.pending[s] = self.pool.submit(self.source.load, s)
            fut = self.pending.pop(step)
        return fut.result()

    def close(self) -> None:
        if self.pool is not None:
            for f in self.pending.values():
                f.cancel()
            self.pending.clear()
            self.pool.shutdown(wait=True)
            self.pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
