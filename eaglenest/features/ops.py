"""Whole-store operations: stats, convert (to another store dtype) and merge (stores captured on
several machines).  convert and merge write through FeatureWriter, so the result has the same
guarantees as a captured store (durable shards, checksummed manifest, resumable, `verify`); each
source sample's checksum is checked on the way, so damage is never carried into a new checksum."""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from eaglenest import EaglenestError
from eaglenest.features.store import (
    IDENTITY_KEYS,
    STORE_DTYPES,
    FeatureStore,
    FeatureWriter,
    StoreMeta,
    decode_sample,
    estimate_bytes,
    free_bytes,
    sample_checksum,
)
from eaglenest.utils import human_bytes, progress, read_jsonl_tolerant


def open_failures(fs: FeatureStore) -> list[dict]:
    """failures.jsonl rows of samples that are still not stored (the last row per id)."""
    stored = set(fs.ids())
    last = {r["id"]: r for r in read_jsonl_tolerant(fs.root / "failures.jsonl") if "id" in r}
    return [r for sid, r in last.items() if sid not in stored]


def stats(path: Path | str) -> dict:
    fs = FeatureStore(path)
    m = fs.meta
    lengths = fs.lengths()
    n_bytes = fs.bytes_on_disk()
    fails = open_failures(fs)
    return {
        "store": str(fs.root),
        "samples": len(fs),
        "tokens": fs.n_tokens,
        "bytes": n_bytes,
        "bytes_per_token": round(n_bytes / fs.n_tokens, 1) if fs.n_tokens else None,
        "dtype": m.dtype,
        "hidden_size": m.hidden_size,
        "num_layers": m.num_layers,
        "layer_ids": m.layer_ids,
        "final_norm": m.final_norm,
        "target": m.target,
        "target_fingerprint": m.target_fingerprint,
        "engine": m.engine,
        "shards": len({e["shard"] for e in fs.entries}),
        "sample_tokens": {"min": min(lengths), "mean": round(sum(lengths) / len(lengths), 1), "max": max(lengths)} if lengths else None,
        "failures": len(fails),
        "failures_by_reason": dict(Counter(r.get("reason", "?") for r in fails)),
    }


@dataclass
class CopySummary:
    written: int = 0
    skipped_done: int = 0
    tokens: int = 0
    bytes_written: int = 0
    damaged: list[str] = field(default_factory=list)  # source samples whose checksum failed
    duplicates: int = 0  # merge: ids held by an earlier source (kept from that one)
    duplicates_differing: int = 0  # ... of which the bytes differ


def _shard_groups(fs: FeatureStore) -> list[list[int]]:
    """Manifest indices grouped by shard, in manifest order: one output shard per source shard."""
    groups: dict[str, list[int]] = {}
    for i, e in enumerate(fs.entries):
        groups.setdefault(e["shard"], []).append(i)
    return list(groups.values())


def _check_room(dst: Path, n_tokens: int, meta: StoreMeta, ignore_disk: bool) -> None:
    need, free = estimate_bytes(n_tokens, meta.hidden_size, meta.dtype, meta.aux_layers), free_bytes(dst)
    if need > free and not ignore_disk:
        raise EaglenestError(f"not enough disk at {dst}: need ~{human_bytes(need)}, {human_bytes(free)} free (override: --ignore-disk)")


def _copy_samples(sources: list[FeatureStore], writer: FeatureWriter, reencode: bool, desc: str) -> CopySummary:
    """Every source sample not yet in `writer`'s store, shard by shard, checksum-checked."""
    s = CopySummary()
    kept: dict[str, str] = {}  # id -> sha256 of the copy written by this run
    todo = sum(e["n_tokens"] for fs in sources for e in fs.entries if e["id"] not in writer.done)
    bar = progress(total=todo, desc=desc, unit="tok", unit_scale=True)
    try:
        for fs in sources:
            for group in _shard_groups(fs):
                batch, btoks = [], 0
                for i in group:
                    e = fs.entries[i]
                    if e["id"] in writer.done:
                        if e["id"] in kept:  # an earlier source of this run has it
                            s.duplicates += 1
                            s.duplicates_differing += kept[e["id"]] != e["sha256"]
                        else:  # stored by an earlier, interrupted run
                            s.skipped_done += 1
                        continue
                    why = "checksum mismatch"
                    try:
                        raw = fs.load_stored(i)
                        ok = sample_checksum(raw, fs.meta.dtype) == e["sha256"]
                    except Exception as x:  # a missing, truncated or garbled shard: reported as damaged, with why
                        fs._handles.pop(e["shard"], None)
                        ok, why = False, f"unreadable shard {e['shard']}: {type(x).__name__}: {x}"
                    if not ok:
                        s.damaged.append(f"{fs.root}: {e['id']} ({why})")
                        continue
                    kept[e["id"]] = e["sha256"]
                    batch.append((e["id"], decode_sample(raw) if reencode else raw))
                    btoks += e["n_tokens"]
                try:
                    s.bytes_written += writer.write_batch(batch, encoded=not reencode)
                except OSError as err:
                    raise EaglenestError(f"writing to {writer.root} failed ({err.strerror or err}); everything written so far is "
                                         "intact: free some space and re-run the same command to resume") from None
                s.written += len(batch)
                s.tokens += btoks
                bar.update(btoks)
    finally:
        bar.close()
    return s


def _carry_failures(sources: list[FeatureStore], writer: FeatureWriter) -> int:
    """Failures of the sources that the output still lacks: the next capture into it retries them."""
    have = {r["id"] for r in read_jsonl_tolerant(writer.root / "failures.jsonl") if "id" in r}
    rows = [r for fs in sources for r in open_failures(fs) if r["id"] not in writer.done and r["id"] not in have]
    rows = list({r["id"]: r for r in rows}.values())
    writer.record_failures(rows)
    return len(rows)


def convert(src: Path | str, dst: Path | str, dtype: str, ignore_disk: bool = False) -> CopySummary:
    """SRC re-encoded into a new store of `dtype` at DST (resumable: re-run to finish)."""
    if dtype not in STORE_DTYPES:
        raise EaglenestError(f"unknown store dtype {dtype!r} (one of: {', '.join(STORE_DTYPES)})")
    fs = FeatureStore(src)
    if Path(dst).resolve() == fs.root.resolve():
        raise EaglenestError("--out must be a new directory, not the source store")
    if fs.meta.dtype == dtype:
        raise EaglenestError(f"{src} already holds dtype {dtype}")
    meta = StoreMeta.from_dict({**fs.meta.to_dict(), "dtype": dtype})
    _check_room(Path(dst), sum(fs.lengths()), meta, ignore_disk)
    writer = FeatureWriter(dst, meta)
    s = _copy_samples([fs], writer, reencode=True, desc=f"convert -> {dtype}")
    _carry_failures([fs], writer)
    _report("convert", s, writer)
    return s


def merge(srcs: list[Path | str], dst: Path | str, ignore_disk: bool = False) -> CopySummary:
    """Stores of one target, layers and dtype (captured on several machines) -> one store at DST.
    A sample id held by several sources is kept from the first one (counted)."""
    if len(srcs) < 2:
        raise EaglenestError("merge needs at least two stores")
    stores = [FeatureStore(p) for p in srcs]
    if any(fs.root.resolve() == Path(dst).resolve() for fs in stores):
        raise EaglenestError("--out must be a new directory (or an earlier merge's output), not one of the inputs")
    ref = stores[0].meta.to_dict()
    for fs in stores[1:]:
        d = fs.meta.to_dict()
        diff = [k for k in IDENTITY_KEYS if d.get(k) != ref.get(k)]
        if diff:
            details = ", ".join(f"{k}: {stores[0].root} has {ref.get(k)!r}, {fs.root} has {d.get(k)!r}" for k in diff)
            raise EaglenestError(f"cannot merge stores of different setups ({details})")
    _check_room(Path(dst), sum(sum(fs.lengths()) for fs in stores), stores[0].meta, ignore_disk)
    writer = FeatureWriter(dst, stores[0].meta)
    s = _copy_samples(stores, writer, reencode=False, desc="merge")
    _carry_failures(stores, writer)
    _report("merge", s, writer)
    return s


def _report(what: str, s: CopySummary, writer: FeatureWriter) -> None:
    extra = f", {s.duplicates} duplicate ids kept from the first store ({s.duplicates_differing} with different bytes)" if s.duplicates else ""
    print(
        f"{what}: wrote {s.written} samples ({s.tokens:,} tokens, {human_bytes(s.bytes_written)}), {s.skipped_done} already there"
        f"{extra}; {len(s.damaged)} damaged in the source (skipped: run `eaglenest features verify` on it); "
        f"{writer.root} now holds {len(writer.done)} samples",
        file=sys.stderr,
    )
    for d in s.damaged[:20]:
        print(f"damaged: {d}", file=sys.stderr)
