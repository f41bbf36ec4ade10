"""Whole-store operations: stats, convert (to another store dtype) and merge (stores captured on
several machines).  convert and merge write through FeatureWriter, so the result has the same
guarantees as a captured store (durable shards, checksummed manifest, resumable, `verify`); each
source sample's checksum is checked on the way, so damage is never carried into a new checksum,
and each sample passes capture's own check (store.validate_sample: shapes, finite values) before
and after re-encoding; one that fails is recorded in OUT/failures.jsonl as capture records it.
Nothing is dropped silently: merge refuses (or, if told, skips or renames) differing samples
under one id, counts identical duplicates, and appends its account to OUT/merges.jsonl."""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

from eaglenest import EaglenestError
from eaglenest.features.store import (
    FP8_BLOCK,
    IDENTITY_KEYS,
    STORE_DTYPES,
    FeatureStore,
    FeatureWriter,
    StoreMeta,
    decode_sample,
    encode_sample,
    estimate_bytes,
    free_bytes,
    sample_checksum,
    validate_sample,
)
from eaglenest.utils import Failures, append_jsonl_durable, human_bytes, progress, read_jsonl_tolerant


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
        "fp8_block": m.fp8_block,
        "scheme": m.scheme,
        "hidden_size": m.hidden_size,
        "num_layers": m.num_layers,
        "layer_ids": m.layer_ids,
        "final_norm": m.final_norm,
        "target": m.target,
        "target_fingerprint": m.target_fingerprint,
        "engine": m.engine,
        "compute_dtype": m.compute_dtype,
        "shards": len({e["shard"] for e in fs.entries}),
        "sample_tokens": {"min": min(lengths), "mean": round(sum(lengths) / len(lengths), 1), "max": max(lengths)} if lengths else None,
        "failures": len(fails),
        "failures_by_reason": dict(Counter(r.get("reason", "?") for r in fails)),
    }


COLLISION_POLICIES = ("error", "skip", "rename")


@dataclass
class CopySummary:
    written: int = 0
    skipped_done: int = 0
    tokens: int = 0
    bytes_written: int = 0
    damaged: list[str] = field(default_factory=list)  # source samples whose checksum failed
    failed: Failures = field(default_factory=Failures)  # samples that fail capture's check (OUT/failures.jsonl)
    duplicates: int = 0  # merge: identical copies (same id, same bytes) of a sample kept from an earlier source
    collisions: list[dict] = field(default_factory=list)  # merge: differing samples under one id, and what was done


def _shard_groups(fs: FeatureStore) -> list[list[int]]:
    """Manifest indices grouped by shard, in manifest order: one output shard per source shard."""
    groups: dict[str, list[int]] = {}
    for i, e in enumerate(fs.entries):
        groups.setdefault(e["shard"], []).append(i)
    return list(groups.values())


def _check_room(dst: Path, n_tokens: int, meta: StoreMeta, ignore_disk: bool) -> None:
    need, free = estimate_bytes(n_tokens, meta.hidden_size, meta.dtype, fp8_block=meta.fp8_block, aux_layers=meta.aux_layers), free_bytes(dst)
    if need > free and not ignore_disk:
        raise EaglenestError(f"not enough disk at {dst}: need ~{human_bytes(need)}, {human_bytes(free)} free (override: --ignore-disk)")


def _where(root: Path, i: int, e: dict) -> str:
    """A manifest entry as a user finds it: store, manifest line, shard."""
    return f"{root}/manifest.jsonl:{i + 1} (shard {e['shard']})"


def _plan_ids(sources: list[FeatureStore], dst: Path, on_collision: str) -> tuple[list[list[str | None]], list[dict]]:
    """The id each source sample is written under (None: not written), sources in order after what
    DST already holds.  The same id with the same bytes is one sample (its copies are dropped at
    copy time); the same id with other bytes is a collision: an error naming both sources, or
    (`on_collision`) the later one skipped or renamed `<id>~<source number>`.  Manifests only: a
    refused merge writes nothing."""
    if on_collision not in COLLISION_POLICIES:
        raise EaglenestError(f"--on-collision must be one of {', '.join(COLLISION_POLICIES)} (got {on_collision})")
    seen = {e["id"]: (e["sha256"], _where(dst, i, e)) for i, e in enumerate(read_jsonl_tolerant(dst / "manifest.jsonl"))}
    names: list[list[str | None]] = []
    collisions: list[dict] = []
    for j, fs in enumerate(sources):
        names.append([])
        for i, e in enumerate(fs.entries):
            sid, where = e["id"], _where(fs.root, i, e)
            if sid not in seen or seen[sid][0] == e["sha256"]:
                seen.setdefault(sid, (e["sha256"], where))
                names[j].append(sid)
                continue
            c = {"id": sid, "kept": seen[sid][1], "other": where}
            if on_collision == "rename":
                new = f"{sid}~{j + 1}"
                while new in seen and seen[new][0] != e["sha256"]:
                    new += "~"
                seen.setdefault(new, (e["sha256"], where))
                c["action"] = f"renamed to {new}"
            else:
                new, c["action"] = None, "skipped"
            names[j].append(new)
            collisions.append(c)
    if on_collision == "error" and collisions:
        shown = "; ".join(f"id {c['id']!r}: {c['kept']} and {c['other']}" for c in collisions[:5])
        raise EaglenestError(
            f"{len(collisions)} sample id(s) hold different samples in different stores ({shown}"
            f"{'; ...' if len(collisions) > 5 else ''}). Prepared ids are `file stem:line` by default, so slices of "
            "same-named files collide: pass --on-collision rename to keep both (the later one as <id>~<store number>) "
            "or --on-collision skip to keep the first")
    return names, collisions


def _checked(raw: dict, src: StoreMeta, dst: StoreMeta, reencode: bool) -> tuple[dict, str | None]:
    """A source sample as DST stores it, and why it fails capture's check (validate_sample) before
    or after re-encoding (None: it passes)."""
    t = decode_sample(raw) if reencode else raw
    why = validate_sample(t, src)
    if why is None and reencode:
        t = encode_sample(t, dst.dtype, dst.fp8_block)
        why = validate_sample(t, dst)
        why = why and f"{why} after encoding to {dst.dtype}"
    return t, why


def _copy_samples(sources: list[FeatureStore], writer: FeatureWriter, reencode: bool, desc: str,
                  names: list[list[str | None]] | None = None) -> CopySummary:
    """Every source sample not yet in `writer`'s store, shard by shard, checksum-checked and
    checked as capture checks a sample; `names`: the id each is written under (_plan_ids)."""
    s = CopySummary()
    names = names or [[e["id"] for e in fs.entries] for fs in sources]
    kept: set[str] = set()  # ids written by this run
    todo = sum(e["n_tokens"] for fs in sources for e in fs.entries if e["id"] not in writer.done)
    bar = progress(total=todo, desc=desc, unit="tok", unit_scale=True)
    try:
        for fs, fs_names in zip(sources, names):
            for group in _shard_groups(fs):
                batch, btoks, bad = [], 0, []
                for i in group:
                    e, sid = fs.entries[i], fs_names[i]
                    if sid is None:  # a collision skipped (_plan_ids)
                        continue
                    if sid in writer.done:
                        if sid in kept:  # an identical copy of a sample this run has written (_plan_ids)
                            s.duplicates += 1
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
                    t, why = _checked(raw, fs.meta, writer.meta, reencode)
                    if why is not None:
                        bad.append({"id": sid, "reason": why.split(":")[0], "message": f"{_where(fs.root, i, e)}: {why}", "time": time.time()})
                        continue
                    kept.add(sid)
                    batch.append((sid, t))
                    btoks += e["n_tokens"]
                try:
                    s.bytes_written += writer.write_batch(batch, encoded=True)
                except OSError as err:
                    raise EaglenestError(f"writing to {writer.root} failed ({err.strerror or err}); everything written so far is "
                                         "intact: free some space and re-run the same command to resume") from None
                writer.record_failures(bad)  # as capture records them: a capture into the output retries them
                for f in bad:
                    s.failed.record(f["reason"], f["message"], where=f"sample {f['id']} not copied", sample_id=f["id"])
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


def convert(src: Path | str, dst: Path | str, dtype: str, ignore_disk: bool = False, fp8_block: int = FP8_BLOCK) -> CopySummary:
    """SRC re-encoded into a new store of `dtype` at DST (resumable: re-run to finish); fp8 stores
    with one scale per `fp8_block` values (as `--fp8-block`: also between fp8 schemes)."""
    if dtype not in STORE_DTYPES:
        raise EaglenestError(f"unknown store dtype {dtype!r} (one of: {', '.join(STORE_DTYPES)})")
    fs = FeatureStore(src)
    if Path(dst).resolve() == fs.root.resolve():
        raise EaglenestError("--out must be a new directory, not the source store")
    meta = fs.meta.with_scheme(dtype, fp8_block)
    if (meta.dtype, meta.fp8_block) == (fs.meta.dtype, fs.meta.fp8_block):
        raise EaglenestError(f"{src} already holds {fs.meta.scheme}")
    _check_room(Path(dst), sum(fs.lengths()), meta, ignore_disk)
    writer = FeatureWriter(dst, meta)
    s = _copy_samples([fs], writer, reencode=True, desc=f"convert -> {meta.scheme}")
    _carry_failures([fs], writer)
    _report("convert", s, writer)
    return s


def merge(srcs: list[Path | str], dst: Path | str, ignore_disk: bool = False, on_collision: str = "error") -> CopySummary:
    """Stores of one target, layers and dtype (captured on several machines) -> one store at DST.
    A sample id held by several sources with the same bytes is kept once (the copies counted);
    with different bytes it is an error naming both, unless `on_collision` is skip or rename
    (_plan_ids).  OUT/merges.jsonl gets one line per run: what was written, dropped, skipped, renamed."""
    if len(srcs) < 2:
        raise EaglenestError("merge needs at least two stores")
    stores = [FeatureStore(p) for p in srcs]
    dst = Path(dst)
    if any(fs.root.resolve() == dst.resolve() for fs in stores):
        raise EaglenestError("--out must be a new directory (or an earlier merge's output), not one of the inputs")
    ref = stores[0].meta.identity()
    for fs in stores[1:]:
        d = fs.meta.identity()
        diff = [k for k in IDENTITY_KEYS if k != "compute_dtype" and d.get(k) != ref.get(k)]
        if diff:
            details = ", ".join(f"{k}: {stores[0].root} has {ref.get(k)!r}, {fs.root} has {d.get(k)!r}" for k in diff)
            raise EaglenestError(f"cannot merge stores of different setups ({details})")
    meta = stores[0].meta
    computed = {fs.root: fs.meta.compute_dtype for fs in stores}
    if len(set(computed.values()) - {None}) > 1:
        raise EaglenestError("cannot merge stores whose states the target computed in different dtypes (compute_dtype: "
                             + ", ".join(f"{r} has {c!r}" for r, c in computed.items()) + ")")
    if None in computed.values():  # one store does not record it: neither can the merge (store.py, "Compute dtype")
        if any(computed.values()):
            print("warning: " + ", ".join(str(r) for r, c in computed.items() if c is None) + " do(es) not record the "
                  "dtype the target computed their states in: the merged store will not either", file=sys.stderr)
        meta = replace(meta, compute_dtype=None)
    names, collisions = _plan_ids(stores, dst, on_collision)
    _check_room(dst, sum(sum(fs.lengths()) for fs in stores), meta, ignore_disk)
    writer = FeatureWriter(dst, meta)
    s = _copy_samples(stores, writer, reencode=False, desc="merge", names=names)
    s.collisions = collisions
    _carry_failures(stores, writer)
    append_jsonl_durable(dst / "merges.jsonl", [{
        "time": time.time(), "sources": [str(fs.root) for fs in stores], "on_collision": on_collision,
        "written": s.written, "already_there": s.skipped_done, "identical_duplicates": s.duplicates,
        "collisions": collisions, "failed": s.failed.summary(), "damaged": s.damaged,
    }])
    _report("merge", s, writer)
    return s


def _report(what: str, s: CopySummary, writer: FeatureWriter) -> None:
    parts = [f"{what}: wrote {s.written} samples ({s.tokens:,} tokens, {human_bytes(s.bytes_written)}), {s.skipped_done} already there"]
    if what == "merge":
        parts.append(f"{s.duplicates} identical duplicate{'s' if s.duplicates != 1 else ''} dropped (same id and bytes in several stores)")
        for action in ("skipped", "renamed"):
            n = sum(c["action"].startswith(action) for c in s.collisions)
            if n:
                parts.append(f"{n} differing sample{'s' if n != 1 else ''} under an id already kept: {action} "
                             f"({writer.root}/merges.jsonl lists them)")
    if s.failed.total:
        parts.append(f"{s.failed.total} samples failed capture's check "
                     f"({', '.join(f'{k}: {v}' for k, v in sorted(s.failed.counts.items()))}): not copied, recorded in {writer.root}/failures.jsonl")
    parts.append(f"{len(s.damaged)} damaged in the source (skipped: run `eaglenest features verify` on it)")
    print("; ".join(parts) + f"; {writer.root} now holds {len(writer.done)} samples", file=sys.stderr)
    for d in s.damaged[:20]:
        print(f"damaged: {d}", file=sys.stderr)
