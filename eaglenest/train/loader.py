"""The trainer's one data path: a *source* turns an optimizer step number into this rank's
collated micro-batches (`StepData`), and a `Prefetcher` runs the source ahead of the loop.

The data order is a pure function of (seed, step) (see data.py), so a source needs no iterator
state and a resumed run asks for the same steps again.  `StoreSource` reads a feature store;
`OnlineSource` (online.py) captures the same micro-batches through an engine.  Both implement
`load(step) -> StepData` and `load_batch(idx) -> Batch | None`; the loop does not change.

Under torchrun each rank's source reads only its own micro-batches (every world-th of the step,
starting at its rank); the loss normalizers are summed over ranks by the trainer, not read.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from eaglenest.features import FeatureStore
from eaglenest.train.compaction import plan_rows
from eaglenest.train.data import Batch, Schedule, collate
from eaglenest.train.ttt import denominators


@dataclass
class StepData:
    step: int
    epoch: int
    batches: list[Batch]  # this rank's micro-batches of the step, collated
    keys: list[tuple[int, ...]]  # their sample indices (the teacher-argmax cache key)
    denom: torch.Tensor  # [ttt] this rank's share of the step's loss normalizers
    failures: list[dict] = field(default_factory=list)  # online: this rank's samples the engine failed on

    @property
    def n_tokens(self) -> int:
        return sum(b.n_tokens for b in self.batches)

    @property
    def n_samples(self) -> int:
        return sum(len(k) for k in self.keys)


def with_plan(b: Batch, ttt: int) -> Batch:
    """The batch with its TTT row plan (train/compaction.py), built here in the loader's thread so
    the training step has no index arithmetic or host sync of its own."""
    b.plan = plan_rows(b.loss_mask, ttt)
    return b


def step_data(step: int, epoch: int, loaded: list[tuple[tuple[int, ...], Batch]], ttt: int, failures=()) -> StepData:
    """StepData of these (sample indices, batch) pairs, with their loss normalizers."""
    denom = torch.zeros(ttt)
    for _, b in loaded:
        denom += denominators(b.loss_mask, ttt)
    return StepData(step, epoch, [b for _, b in loaded], [k for k, _ in loaded], denom, list(failures))


class Source:
    """What every source shares: which micro-batches of a step are this rank's."""

    def __init__(self, schedule: Schedule, ttt: int, max_len: int, rank: int = 0, world: int = 1, pin: bool = False):
        self.schedule, self.ttt, self.max_len = schedule, ttt, max_len
        self.rank, self.world, self.pin = rank, world, pin

    def micro_batches(self, step: int) -> tuple[int, list[list[int]]]:
        """(epoch, the sample indices of this rank's micro-batches of `step`)."""
        epoch, batches = self.schedule.step_batches(step)
        return epoch, [b for k, b in enumerate(batches) if k % self.world == self.rank]


class StoreSource(Source):
    """Micro-batches of a step read from a feature store: this rank's share only."""

    def __init__(self, store: FeatureStore, schedule: Schedule, ttt: int, max_len: int, rank: int = 0, world: int = 1, pin: bool = False):
        super().__init__(schedule, ttt, max_len, rank, world, pin)
        self.store = store

    def load_batch(self, idx: list[int]) -> Batch:
        b = with_plan(collate(self.store, idx, self.max_len), self.ttt)
        return b.pin_memory() if self.pin else b

    def load(self, step: int) -> StepData:
        epoch, mine = self.micro_batches(step)
        return step_data(step, epoch, [(tuple(idx), self.load_batch(idx)) for idx in mine], self.ttt)


class _Workers:
    """A few daemon threads running submitted calls.  Not ThreadPoolExecutor: its threads are
    joined at interpreter exit, so one read hung on a dead server would keep a stopped run alive
    until the server's own timeout."""

    def __init__(self, n: int, name: str):
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def submit(self, fn, *args) -> Future:
        f: Future = Future()
        self.q.put((f, fn, args))
        return f

    def _run(self) -> None:
        while (item := self.q.get()) is not None:
            f, fn, args = item
            if f.set_running_or_notify_cancel():
                try:
                    f.set_result(fn(*args))
                except BaseException as e:  # handed to whoever waits on the step
                    f.set_exception(e)

    def shutdown(self, wait: bool) -> None:
        for _ in self.threads:
            self.q.put(None)
        if wait:
            for t in self.threads:
                t.join()


class Prefetcher:
    """Loads steps [s, s + depth] in `threads` background threads while the loop computes step s
    (bounded: at most depth + 1 steps of batches exist at once).  Steps are handed out in order;
    depth 0 loads in the caller's thread.  Reading is I/O and collation is torch copies, which
    release the GIL, so one thread overlaps the step's compute.  `get(step, timeout)` raises
    TimeoutError when the step is not ready in time (an online source's engine that stopped
    answering); leaving the `with` block on an error does not wait for a hung read."""

    def __init__(self, source, depth: int = 2, threads: int = 1, end: int | None = None):
        self.source, self.depth, self.end = source, depth, end
        self.pool = _Workers(threads, "eaglenest-loader") if depth > 0 else None
        self.pending: dict[int, Future] = {}
        self.lock = threading.Lock()

    def get(self, step: int, timeout: float | None = None) -> StepData:
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
            fut = self.pending[step]
        try:
            out = fut.result(timeout)
        except concurrent.futures.TimeoutError:  # not the built-in TimeoutError before Python 3.11: callers catch that one
            raise TimeoutError(f"step {step} not loaded within {timeout} s") from None  # the step stays pending: a retry waits on the same read
        with self.lock:
            self.pending.pop(step, None)
        return out

    def close(self, wait: bool = True) -> None:
        if self.pool is not None:
            for f in self.pending.values():
                f.cancel()
            self.pending.clear()
            self.pool.shutdown(wait)
            self.pool = None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        self.close(wait=exc_type is None)
