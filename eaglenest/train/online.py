"""Online training: the engine's hidden states go straight into the trainer, no feature store.

`eaglenest train --online --data DATA_DIR --engine hf|vllm|sglang [engine flags]` replaces the
feature store by `OnlineData` (the prepared ids, seen as the store a complete `capture` of them
would write) and `StoreSource` by `OnlineSource`, which captures each step's micro-batches through
the same `Engine.capture` and the same checks (`capture.run.validated`: echo, shapes, finite
values) as `eaglenest capture`.  The trainer's prefetcher (loader.py) is the bounded in-memory
queue between the engine and the loop: at most `--prefetch` + 1 steps of features exist at once.
Only checkpoints and logs are written (RUN_DIR/failures.jsonl holds the skipped samples).

Facts a store would give, and where they come from online:
  * sample order: a store holds the samples in capture order (by length, then position in DATA);
    OnlineData uses that order, so the Schedule, the held-out split and the run fingerprint are
    those of an offline run on a complete capture of the same DATA (same seed -> same steps);
  * draft vocabulary: DATA's loss-masked token counts (token_counts.safetensors, written by
    prepare), which are the store's counts when the capture stored every sample;
  * fc init statistics: the first FC_RMS_SAMPLES samples in that order, captured once at start
    (rank 0, like the store read), at full length as the store holds them.
Epochs > 1 re-capture (no feature cache: memory stays at the queue's, the cost is one more target
forward per sample and epoch); the held-out batches are captured at each evaluation.

A sample the engine fails on (after the HTTP client's retries) is left out of its step and
recorded with its reason; it is not retried later or replaced, so the order stays a pure function
of (seed, step) and a resumed run asks for the same steps again.  A resumed run therefore equals
the uninterrupted one when the same samples arrive (always, on the hf engine).  A step of which no
sample arrived because the engine is unreachable, a step not ready within --online-timeout, or
more failures than --max-failures stop the run with a checkpoint at that step: `--resume` once the
engine is back continues exactly there.
"""

from __future__ import annotations

import argparse
import json
import math
import threading
from pathlib import Path

import torch

from eaglenest import EaglenestError
from eaglenest.capture.run import plan_batches, store_meta_for, validated
from eaglenest.data import PreparedData, Sample
from eaglenest.engines.base import Engine, Failure, Request
from eaglenest.train.data import Batch, collate_items
from eaglenest.train.loader import Source, StepData, step_data, with_plan
from eaglenest.train.setup import FC_RMS_SAMPLES, aux_rms
from eaglenest.utils import append_jsonl_durable, atomic_write_bytes, human_bytes, read_jsonl_tolerant


class OnlineStop(Exception):
    """The run cannot go on with this engine now (the trainer saves a checkpoint and says why)."""


# --- the engine ---------------------------------------------------------------------------------
def rank_urls(urls: list[str], rank: int) -> list[str]:
    """The server pool as rank `rank` uses it: every rank talks to every server (a dead one is
    skipped by the client's retries), starting at server rank % S, so ranks that send in step
    start on different servers whatever the rank and server counts."""
    k = rank % len(urls) if urls else 0
    return list(urls[k:]) + list(urls[:k])


def make_engine(cfg, args: argparse.Namespace | None, device: str, rank: int, world: int) -> Engine:
    """The engine `--engine` names, created from the same flags `capture` takes (`args`; None:
    the engine's defaults).  The target, its dtype and the layers come from the run's config;
    the hf engine runs on the trainer's device (target and draft in one process)."""
    from eaglenest.engines import add_engine_arguments, get_engine_module

    mod = get_engine_module(cfg.engine)
    if args is None:
        p = argparse.ArgumentParser()
        add_engine_arguments(p, {cfg.engine: mod})
        args = p.parse_args([])
    ns = argparse.Namespace(**vars(args))
    ns.model, ns.dtype, ns.layers, ns.device = cfg.model, cfg.capture_dtype, cfg.layers, device
    urls = {k: v for k, v in vars(ns).items() if k.endswith("_url") and isinstance(v, list) and v}
    if world > 1 and cfg.engine != "hf" and not urls:
        raise EaglenestError(f"--online --engine {cfg.engine} under torchrun needs running servers (--{cfg.engine}-url URL, "
                             "repeatable): every rank pulls its own samples from them; a server per rank is not started")
    for k, v in urls.items():
        setattr(ns, k, rank_urls(v, rank))
    return mod.create(ns)


def engine_memory(engine: Engine) -> dict:
    """What the engine holds in this process: the hf engine's target parameters; a server
    engine's target lives in its servers."""
    model = getattr(engine, "model", None)
    if isinstance(model, torch.nn.Module):
        n = sum(p.numel() for p in model.parameters())
        b = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
        return {"where": f"this process ({getattr(engine, 'device', '?')})", "target_params": n, "target_bytes": b}
    return {"where": "its servers", "target_params": 0, "target_bytes": 0}


# --- the data -----------------------------------------------------------------------------------
class OnlineData:
    """A prepared DATA_DIR seen as the feature store a complete capture of it would be: `meta`,
    `ids()`, `lengths()` in store order; hidden states come from the engine on demand.  Thread-safe:
    engine calls are serialized (the hf engine keeps per-call state; a server engine's concurrency
    is its own --*-concurrency)."""

    def __init__(self, data: PreparedData, engine: Engine, dtype: str):
        self.data, self.engine = data, engine
        self.meta = store_meta_for(engine, dtype)
        if self.meta.vocab_size and data.vocab_size > self.meta.vocab_size:
            raise EaglenestError(f"{data.path}: prepared with a tokenizer of {data.vocab_size} ids but the target has {self.meta.vocab_size}")
        lengths = data.lengths()
        self.order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))  # plan_batches' order = capture's
        all_ids = data.ids()
        self._ids = [all_ids[i] for i in self.order]
        self._lengths = [lengths[i] for i in self.order]
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.order)

    def ids(self) -> list[str]:
        return self._ids

    def lengths(self) -> list[int]:
        return self._lengths

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """Loss-masked token counts of DATA (int64 [vocab_size]): what vocab_counts() gives for a complete store."""
        counts = self.data.token_counts()
        if counts.numel() > vocab_size:
            raise EaglenestError(f"{self.data.path}: token counts cover {counts.numel()} ids, the target has {vocab_size}")
        return torch.nn.functional.pad(counts, (0, vocab_size - counts.numel()))

    def sample(self, i: int, max_len: int | None = None) -> Sample:
        s = self.data[self.order[i]]
        return Sample(s.id, s.input_ids[:max_len], s.loss_mask[:max_len]) if max_len else s

    def capture(self, idx: list[int], max_len: int | None) -> tuple[list[tuple[int, dict]], list[Failure]]:
        """Samples `idx` (store order), truncated to max_len: ((index, tensors) of those that passed the
        checks, in order; the Failures of the others)."""
        samples = [self.sample(i, max_len) for i in idx]
        reqs = [Request(s.id, list(s.input_ids)) for s in samples]
        with self.lock:
            results = self.engine.capture(reqs)
        good, bad = validated(zip(samples, reqs, results), self.meta)
        where = {s.id: i for i, s in zip(idx, samples)}
        return [(where[sid], t) for sid, t in good], bad

    def fc_input_rms(self, batch_tokens: int, n_samples: int = FC_RMS_SAMPLES, normed: bool = False) -> tuple[torch.Tensor | None, list[Failure]]:
        """setup.fc_input_rms of the store a capture would write: its first samples, full length."""
        first = list(range(min(n_samples, len(self))))
        auxes, failed = [], []
        for b in plan_batches([self._lengths[i] for i in first], batch_tokens):
            got, bad = self.capture([first[j] for j in b], None)
            auxes += [(i, t["aux_hidden_states"]) for i, t in got]
            failed += bad
        return aux_rms((a for _, a in sorted(auxes, key=lambda x: x[0])), normed), failed


class OnlineSource(Source):
    """This rank's micro-batches of a step, captured by the engine; failed samples are left out
    of their micro-batch (and recorded), a micro-batch with none left is dropped."""

    def __init__(self, data: OnlineData, schedule, ttt: int, max_len: int, rank: int = 0, world: int = 1, pin: bool = False,
                 log: "FailureLog | None" = None):
        super().__init__(schedule, ttt, max_len, rank, world, pin)
        self.data, self.log = data, log

    def _capture(self, idx: list[int]) -> tuple[tuple[tuple[int, ...], Batch] | None, list[Failure]]:
        got, bad = self.data.capture(idx, self.max_len)
        if not got:
            return None, bad
        b = with_plan(collate_items([t for _, t in got], self.max_len), self.ttt)
        return (tuple(i for i, _ in got), b.pin_memory() if self.pin else b), bad

    def load_batch(self, idx: list[int], step: int = 0) -> Batch | None:
        """A held-out micro-batch (evaluation): what arrived of it, or None."""
        got, bad = self._capture(idx)
        if self.log:
            self.log.record(bad, step, self.rank, "eval")
        return got[1] if got else None

    def load(self, step: int) -> StepData:
        epoch, mine = self.micro_batches(step)
        loaded, failed = [], []
        for idx in mine:
            got, bad = self._capture(idx)
            failed += bad
            if got:
                loaded.append(got)
        rows = self.log.record(failed, step + 1, self.rank, "train") if self.log else failure_rows(failed, step + 1, self.rank, "train")
        return step_data(step, epoch, loaded, self.ttt, rows)


# --- failures -----------------------------------------------------------------------------------
def failure_rows(failed: list[Failure], step: int, rank: int, phase: str) -> list[dict]:
    return [{"step": step, "rank": rank, "phase": phase, "id": f.id, "reason": f.reason, "message": f.message} for f in failed]


class FailureLog:
    """RUN_DIR/failures.jsonl: one line per sample the engine failed on, with its optimizer step
    (1-based, as in metrics.jsonl), rank, phase (train | eval | setup) and reason.  Every rank
    appends its own lines (one O_APPEND write each); a resumed run drops the lines past its
    checkpoint first (rank 0), since those steps are captured again."""

    def __init__(self, out: Path | str):
        self.path = Path(out) / "failures.jsonl"

    def start(self, step: int) -> None:
        rows = [r for r in read_jsonl_tolerant(self.path) if r["step"] <= step] if step else []
        atomic_write_bytes(self.path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows).encode())

    def record(self, failed: list[Failure], step: int, rank: int, phase: str) -> list[dict]:
        rows = failure_rows(failed, step, rank, phase)
        if rows:
            from tqdm.auto import tqdm

            append_jsonl_durable(self.path, rows)
            for r in rows:
                tqdm.write(f"warning: online {phase} step {step}: sample {r['id']} skipped ({r['reason']}: {r['message'][:300]})")
        return rows

    def summary(self, step: int) -> dict:
        """Counts by phase and reason of the lines up to `step`."""
        out: dict = {"total": 0}
        for r in read_jsonl_tolerant(self.path):
            if r["step"] <= step:
                by = out.setdefault(r["phase"], {})
                by[r["reason"]] = by.get(r["reason"], 0) + 1
                out["total"] += 1
        return out


def describe_failures(summary: dict) -> str:
    parts = [f"{phase} {', '.join(f'{k}: {v}' for k, v in sorted(by.items()))}" for phase, by in sorted(summary.items()) if phase != "total"]
    return f"{summary['total']} samples skipped" + (f" ({'; '.join(parts)})" if parts else "")


def queue_bytes(prefetch: int, grad_accum: int, world: int, batch_tokens: int, hidden: int, dtype: str) -> int:
    """Upper bound of the features in the prefetch queue: (prefetch + 1) steps of this rank's
    micro-batches, batch_tokens padded tokens each, 4 states of `hidden` values per token."""
    item = {"bf16": 2, "fp16": 2, "fp32": 4}[dtype]
    return (prefetch + 1) * math.ceil(grad_accum / world) * batch_tokens * (4 * hidden * item + 16)


def memory_line(engine_mem: dict, draft: torch.nn.Module, queue: int) -> str:
    trainable = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    draft_b = sum(p.numel() * p.element_size() for p in draft.parameters())
    tgt = (f"target {engine_mem['target_params'] / 1e6:.1f}M params = {human_bytes(engine_mem['target_bytes'])} in {engine_mem['where']}"
           if engine_mem["target_bytes"] else f"target in {engine_mem['where']}")
    return (f"online: {tgt}; draft {human_bytes(draft_b)} + AdamW state {human_bytes(8 * trainable)}; "
            f"feature queue <= {human_bytes(queue)}")
