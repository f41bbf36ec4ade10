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
from eaglenest.features.store import (
    FP8_BLOCK,
    FeatureWriter,
    StoreMeta,
    bytes_per_token,
    estimate_bytes,
    fp8_block_for,
    free_bytes,
    is_fp8,
    validate_sample,
)
from eaglenest.utils import Failures, human_bytes, progress

# `--store-dtype auto`: targets this wide get the compact store (measured: bench/results/store_dtype.json)
COMPACT_FROM_HIDDEN = 4096
COMPACT_DTYPE = "fp8"


def resolve_store_dtype(store_dtype: str, model_dtype: str, hidden_size: int) -> tuple[str, str]:
    """(store dtype, why) for `--store-dtype` and `--dtype`.  auto = the compact store for wide
    targets run in bf16, else the target's dtype: a run in fp32 asks for fp32 precision, and its
    store keeps it (an fp8 store of an fp32 run needs --store-dtype fp8, said on the line)."""
    if store_dtype != "auto":
        return store_dtype, "--store-dtype"
    if model_dtype != "bf16":
        return model_dtype, f"auto: the target runs in {model_dtype}, the store keeps it"
    if hidden_size >= COMPACT_FROM_HIDDEN:
        return COMPACT_DTYPE, f"auto: hidden size {hidden_size} >= {COMPACT_FROM_HIDDEN}; --store-dtype bf16 keeps bf16"
    return model_dtype, f"auto: hidden size {hidden_size} < {COMPACT_FROM_HIDDEN}"


def check_room(out: Path, n_tokens: int, hidden_size: int, store_dtype: str, ignore_disk: bool, *,
               fp8_block: int | None = None, aux_layers: int = 3) -> None:
    """Refuse to start a capture the disk at `out` cannot hold (`aux_layers`: how many layers it captures)."""
    need, free = estimate_bytes(n_tokens, hidden_size, store_dtype, fp8_block=fp8_block, aux_layers=aux_layers), free_bytes(out)
    if need > free and not ignore_disk:
        raise EaglenestError(
            f"not enough disk at {out}: {n_tokens:,} tokens in {store_dtype} need ~{human_bytes(need)}, "
            f"{human_bytes(free)} free (override: --ignore-disk)"
        )


def print_plan(out: Path, target: str, hidden_size: int, num_layers: int, n_samples: int | None, n_tokens: int,
               n_done: int, store_dtype: str, model_dtype: str, layer_ids: list[int], fp8_block: int | None = None) -> bool:
    """The dry run: bytes per token and total size in every store dtype for the `layer_ids` captured,
    free disk; True if the chosen one fits."""
    free = free_bytes(out)
    n = len(layer_ids)
    lines = [
        f"capture plan: {f'{n_samples:,} samples / ' if n_samples is not None else ''}{n_tokens:,} tokens to process"
        f"{f' ({n_done} already stored)' if n_done else ''}; target {target} ({num_layers} layers, hidden {hidden_size}); "
        f"aux layers {layer_ids} ({n} x {hidden_size} + the final state per token)",
        f"  {'store dtype':<16}{'bytes/token':>12}{'total':>12}{'vs bf16':>9}",
    ]
    for d in dict.fromkeys(["bf16", model_dtype, "fp8", "fp8-aux", store_dtype]):
        per = bytes_per_token(hidden_size, d, fp8_block=fp8_block, aux_layers=n)
        mark = " <- this run" if d == store_dtype else ""
        lines.append(f"  {d:<16}{per:>12,}{human_bytes(per * n_tokens):>12}{per / bytes_per_token(hidden_size, 'bf16', aux_layers=n):>8.2f}x{mark}")
    need = estimate_bytes(n_tokens, hidden_size, store_dtype, fp8_block=fp8_block, aux_layers=n)
    fits = need <= free
    lines.append(f"free at {out}: {human_bytes(free)}; {store_dtype} needs ~{human_bytes(need)} on disk: "
                 + ("fits" if fits else "does NOT fit, capture would refuse to start (override: --ignore-disk)"))
    print("\n".join(lines), file=sys.stderr)
    return fits


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


def store_meta_for(engine: Engine, dtype: str, fp8_block: int = FP8_BLOCK) -> StoreMeta:
    """`dtype`: the store dtype (STORE_DTYPES); fp8_block as `--fp8-block` (fp8 stores only)."""
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
        fp8_block=fp8_block_for(info.hidden_size, fp8_block) if is_fp8(dtype) else None,
        compute_dtype=info.compute_dtype,
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
    fp8_block: int = FP8_BLOCK,
) -> CaptureSummary:
    """`data` is a PreparedData (or any sequence of samples with id/input_ids/loss_mask);
    `dtype` is the store dtype (bf16, fp32, fp8, ...: STORE_DTYPES), fp8_block as `--fp8-block`."""
    meta = store_meta_for(engine, dtype, fp8_block)
    samples = [data[i] for i in range(len(data) if limit is None else min(limit, len(data)))]
    if data_vocab := getattr(data, "meta", {}).get("vocab_size"):
        if meta.vocab_size and data_vocab > meta.vocab_size:
            raise EaglenestError(f"prepared data uses a tokenizer of {data_vocab} ids but the target has {meta.vocab_size}")
    writer = None if dry_run else FeatureWriter(out, meta)
    done = writer.done if writer else _done_ids(out)
    todo_tokens = sum(len(s.input_ids) for s in samples if s.id not in done)
    n_todo = sum(1 for s in samples if s.id not in done)
    need = estimate_bytes(todo_tokens, meta.hidden_size, dtype, fp8_block=meta.fp8_block, aux_layers=meta.aux_layers)
    free = free_bytes(out)
    print(
        f"capture: {n_todo} samples / {todo_tokens:,} tokens to process ({len(samples) - n_todo} already stored); "
        f"needs ~{human_bytes(need)} on disk ({meta.scheme}), {human_bytes(free)} free at {out}",
        file=sys.stderr,
    )
    if dry_run:
        return CaptureSummary(0, len(samples) - n_todo, 0, todo_tokens, 0.0, 0, {"estimate_bytes": need, "free_bytes": free})
    check_room(out, todo_tokens, meta.hidden_size, dtype, ignore_disk, fp8_block=meta.fp8_block, aux_layers=meta.aux_layers)

    failures = Failures()
    lengths = [len(s.input_ids) for s in samples]
    t0, stored, tokens, written = time.time(), 0, 0, 0
    bar = progress(total=todo_tokens, desc="capture", unit="tok", unit_scale=True)

    def keep(batch: list[int], reqs: list[Request], handle) -> None:
        """Validate one batch's results and write them as one shard."""
        nonlocal stored, tokens, written
        btoks = sum(lengths[i] for i in batch if samples[i].id not in done)
        good, bad = validated(((samples[i], req, res) for i, req, res in zip(batch, reqs, handle.result())
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

    try:
        pending = None
        for batch in plan_batches(lengths, batch_tokens):
            if all(samples[i].id in done for i in batch):
                continue
            reqs = [Request(samples[i].id, list(samples[i].input_ids)) for i in batch]
            handle = engine.capture_async(reqs)  # started before the previous batch is stored: they overlap
            if pending is not None:
                keep(*pending)
            pending = (batch, reqs, handle)
        if pending is not None:
            keep(*pending)
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
