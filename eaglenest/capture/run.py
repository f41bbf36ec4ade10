"""`eaglenest capture`: prepared token ids -> feature store, through any engine.

Batches are planned over the *whole* data set (sorted by length, ties by position), never over
what is left, so a resumed run recomputes a batch with the same composition as the uninterrupted
run and writes bit-identical features.  Stored samples are skipped; a batch is written as one
shard, atomically, then named in the manifest.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from eaglenest import EaglenestError
from eaglenest.engines.base import Captured, Engine, Failure, Request, check_echo
from eaglenest.features.store import FeatureWriter, StoreMeta, estimate_bytes, free_bytes, validate_sample
from eaglenest.utils import Failures, human_bytes, progress


@dataclass
class CaptureSummary:
    stored: int
    skipped_done: int
    failed: int
    tokens: int
    seconds: float
    bytes_written: int
    failures: dict
    requests: dict | None = None  # a server engine's account of its HTTP requests (engines/http.py)


def plan_batches(lengths: list[int], batch_tokens: int, max_batch: int = 256) -> list[list[int]]:
    """Group sample indices by length so that (batch size x longest) <= batch_tokens."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches, cur, cur_max = [], [], 0
    for i in order:
        m = max(cur_max, lengths[i])
        if cur and (m * (len(cur) + 1) > batch_tokens or len(cur) >= max_batch):
            batches.append(cur)
            cur, m = [], lengths[i]
        cur.append(i)
        cur_max = m
    if cur:
        batches.append(cur)
    return batches


def store_meta_for(engine: Engine, dtype: str) -> StoreMeta:
    info = engine.info()
    return StoreMeta(
        target=info.target,
        target_fingerprint=info.target_fingerprint,
        hidden_size=info.hidden_size,
        num_layers=info.num_layers,
        layer_ids=list(info.layer_ids),
        final_norm=info.final_norm,
        dtype=dtype,
        engine=engine.name,
        vocab_size=info.vocab_size,
    )


def validated(triples, meta: StoreMeta) -> tuple[list[tuple[str, dict]], list[Failure]]:
    """(sample, request, engine result) triples -> ((id, tensors) of the samples whose result passed
    the echo and validity checks, Failures of the others).  Shared by capture and online training."""
    good, bad = [], []
    for s, req, res in triples:
        if isinstance(res, Captured):
            res = check_echo(req.input_ids, res.input_ids, s.id) or res
        if isinstance(res, Captured):
            t = {
                "input_ids": torch.tensor(s.input_ids, dtype=torch.int32),
                "loss_mask": torch.tensor(s.loss_mask, dtype=torch.uint8),
                "aux_hidden_states": res.aux_hidden_states,
                "last_hidden_state": res.last_hidden_state,
            }
            why = validate_sample(t, meta)
            if why is None:
                good.append((s.id, t))
                continue
            res = Failure(s.id, why.split(":")[0], why)
        bad.append(res)
    return good, bad


def run_capture(
    engine: Engine,
    data,
    out: Path,
    *,
    dtype: str = "bf16",
    batch_tokens: int = 8192,
    dry_run: bool = False,
    ignore_disk: bool = False,
    max_failures: int | None = None,
    limit: int | None = None,
) -> CaptureSummary:
    """`data` is a PreparedData (or any sequence of samples with id/input_ids/loss_mask)."""
    meta = store_meta_for(engine, dtype)
    samples = [data[i] for i in range(len(data) if limit is None else min(limit, len(data)))]
    if data_vocab := getattr(data, "meta", {}).get("vocab_size"):
        if meta.vocab_size and data_vocab > meta.vocab_size:
            raise EaglenestError(f"prepared data uses a tokenizer of {data_vocab} ids but the target has {meta.vocab_size}")
    writer = None if dry_run else FeatureWriter(out, meta)
    done = writer.done if writer else _done_ids(out)
    todo_tokens = sum(len(s.input_ids) for s in samples if s.id not in done)
    n_todo = sum(1 for s in samples if s.id not in done)
    need = estimate_bytes(todo_tokens, meta.hidden_size, dtype)
    free = free_bytes(out)
    print(
        f"capture: {n_todo} samples / {todo_tokens:,} tokens to process ({len(samples) - n_todo} already stored); "
        f"needs ~{human_bytes(need)} on disk, {human_bytes(free)} free at {out}",
        file=sys.stderr,
    )
    if dry_run:
        return CaptureSummary(0, len(samples) - n_todo, 0, todo_tokens, 0.0, 0, {"estimate_bytes": need, "free_bytes": free})
    if need > free and not ignore_disk:
        raise EaglenestError(f"not enough disk at {out}: need ~{human_bytes(need)}, {human_bytes(free)} free (override: --ignore-disk)")

    failures = Failures()
    lengths = [len(s.input_ids) for s in samples]
    t0, stored, tokens, written = time.time(), 0, 0, 0
    bar = progress(total=todo_tokens, desc="capture", unit="tok", unit_scale=True)
    try:
        for batch in plan_batches(lengths, batch_tokens):
            if all(samples[i].id in done for i in batch):
                continue
            btoks = sum(lengths[i] for i in batch if samples[i].id not in done)
            reqs = [Request(samples[i].id, list(samples[i].input_ids)) for i in batch]
            results = engine.capture(reqs)
            good, bad = validated(((samples[i], req, res) for i, req, res in zip(batch, reqs, results)
                                   if samples[i].id not in done), meta)
            try:
                written += writer.write_batch(good)
            except OSError as e:
                raise EaglenestError(
                    f"writing to {out} failed ({e.strerror or e}); everything stored so far is intact: "
                    "free some space and re-run the same command to resume"
                ) from None
            stored += len(good)
            tokens += btoks
            for f in bad:
                failures.record(f.reason, f.message, where=f"sample {f.id}", sample_id=f.id)
            writer.record_failures({"id": f.id, "reason": f.reason, "message": f.message, "time": time.time()} for f in bad)
            bar.update(btoks)
            bar.set_postfix(samples=stored, failed=failures.total)
            if max_failures is not None and failures.total > max_failures:
                raise EaglenestError(f"stopping: {failures.total} failures exceed --max-failures {max_failures} ({failures.format()})")
    finally:
        bar.close()
    dt = time.time() - t0
    print(
        f"capture: stored {stored} samples ({tokens:,} tokens, {tokens / max(dt, 1e-9):,.0f} tok/s, "
        f"{human_bytes(written)}); {failures.format()}; store now holds {len(writer.done)} samples",
        file=sys.stderr,
    )
    requests = engine.request_stats()
    if requests is not None:
        from eaglenest.engines.http import describe

        print(f"capture: engine requests: {describe(requests)}", file=sys.stderr)
    return CaptureSummary(stored, len(samples) - n_todo, failures.total, tokens, dt, written, failures.summary(), requests)


def _done_ids(out: Path) -> set[str]:
    from eaglenest.utils import read_jsonl_tolerant

    return {e["id"] for e in read_jsonl_tolerant(Path(out) / "manifest.jsonl")}
