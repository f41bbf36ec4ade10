"""The feature store: safetensors shards + an append-only manifest with per-sample checksums.

Layout of FEAT_DIR:
    store.json        metadata written once at creation (target, layer ids, convention, final-norm
                      flag, dtype, hidden size); a re-run must match it or fail loudly
    shards/NNNNNN-<rand>.safetensors
                      one file per capture batch; sample k's tensors are named
                      `k.input_ids` (int32 [T]), `k.loss_mask` (uint8 [T]),
                      `k.aux_hidden_states` ([T, 3H]), `k.last_hidden_state` ([T, H])
    manifest.jsonl    one line per stored sample: {id, shard, key, n_tokens, sha256};
                      appended (and fsynced) only after its shard is durable on disk
    failures.jsonl    samples that failed capture, with reasons (retried on the next run)

Durability: a shard is written to a temp name, fsynced and renamed, *then* its manifest lines are
appended.  A kill at any point leaves either a complete sample or nothing (an orphan shard that
the next run deletes); the manifest is the only source of truth, so there are never duplicates.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
from safetensors import safe_open
from safetensors.torch import save as st_save

from eaglenest import EaglenestError
from eaglenest.utils import (
    append_jsonl_durable,
    atomic_write_bytes,
    atomic_write_json,
    read_json,
    read_jsonl_tolerant,
    sha256_bytes,
)

FORMAT_VERSION = 1
TENSORS = ("input_ids", "loss_mask", "aux_hidden_states", "last_hidden_state")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
# metadata fields that must agree between a store and the run that appends to it
IDENTITY_KEYS = ("target_fingerprint", "hidden_size", "num_layers", "layer_ids", "convention", "final_norm", "dtype")


@dataclass
class StoreMeta:
    target: str
    target_fingerprint: str
    hidden_size: int
    num_layers: int
    layer_ids: list[int]  # capture-before convention
    final_norm: str  # "post": last_hidden_state is after the final norm; "pre": before it
    dtype: str  # bf16 | fp32 | fp16
    engine: str
    convention: str = "capture-before"
    vocab_size: int | None = None
    format_version: int = FORMAT_VERSION

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: dict) -> "StoreMeta":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def sample_checksum(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the raw bytes of the sample's tensors in a fixed order."""
    return sha256_bytes(*(tensors[n].contiguous().view(torch.uint8).numpy().tobytes() for n in TENSORS))


def validate_sample(t: dict[str, torch.Tensor], meta: StoreMeta) -> str | None:
    """Return why a captured sample is unusable, or None."""
    T = t["input_ids"].shape[0]
    H = meta.hidden_size
    expect = {"input_ids": (T,), "loss_mask": (T,), "aux_hidden_states": (T, 3 * H), "last_hidden_state": (T, H)}
    for name, shape in expect.items():
        if tuple(t[name].shape) != shape:
            return f"bad_shape: {name} {tuple(t[name].shape)} != {shape}"
    for name in ("aux_hidden_states", "last_hidden_state"):
        if not torch.isfinite(t[name].float()).all():
            return f"non_finite: {name} has NaN/Inf"
    return None


class FeatureWriter:
    """Appends captured samples to a store; safe to kill at any moment and re-open to resume."""

    def __init__(self, root: Path | str, meta: StoreMeta):
        self.root = Path(root)
        self.meta = meta
        (self.root / "shards").mkdir(parents=True, exist_ok=True)
        existing = self.root / "store.json"
        if existing.exists():
            old = read_json(existing, "store metadata")
            diff = [k for k in IDENTITY_KEYS if old.get(k) != meta.to_dict().get(k)]
            if diff:
                details = ", ".join(f"{k}: store has {old.get(k)!r}, this run {meta.to_dict().get(k)!r}" for k in diff)
                raise EaglenestError(f"{self.root} holds features from a different setup ({details}); use another --out")
        else:
            atomic_write_json(existing, meta.to_dict())
        self.manifest_path = self.root / "manifest.jsonl"
        self.entries = read_jsonl_tolerant(self.manifest_path)
        self._truncate_torn_manifest()
        self.done = {e["id"] for e in self.entries}
        self._remove_orphans()

    def _truncate_torn_manifest(self) -> None:
        """Drop a torn last line (kill mid-append) so the next append starts on a fresh line."""
        if not self.manifest_path.exists():
            return
        data = self.manifest_path.read_bytes()
        if data and not data.endswith(b"\n"):
            keep = data[: data.rfind(b"\n") + 1]
            atomic_write_bytes(self.manifest_path, keep)

    def _remove_orphans(self) -> None:
        """Shards not referenced by the manifest come from a killed run: delete them (and temp files)."""
        referenced = {e["shard"] for e in self.entries}
        for f in (self.root / "shards").iterdir():
            if f.name not in referenced:
                f.unlink(missing_ok=True)

    def write_batch(self, samples: list[tuple[str, dict[str, torch.Tensor]]]) -> int:
        """Write one shard with these (id, tensors) samples; returns the bytes written."""
        samples = [(sid, t) for sid, t in samples if sid not in self.done]
        if not samples:
            return 0
        tensors, rows = {}, []
        name = f"{len(self.entries):09d}-{secrets.token_hex(4)}.safetensors"
        for k, (sid, t) in enumerate(samples):
            t = {
                "input_ids": t["input_ids"].to(torch.int32).cpu().contiguous(),
                "loss_mask": t["loss_mask"].to(torch.uint8).cpu().contiguous(),
                "aux_hidden_states": t["aux_hidden_states"].to(DTYPES[self.meta.dtype]).cpu().contiguous(),
                "last_hidden_state": t["last_hidden_state"].to(DTYPES[self.meta.dtype]).cpu().contiguous(),
            }
            for n in TENSORS:
                tensors[f"{k}.{n}"] = t[n]
            rows.append({"id": sid, "shard": name, "key": str(k), "n_tokens": int(t["input_ids"].shape[0]), "sha256": sample_checksum(t)})
        data = st_save(tensors, metadata={"format": "eaglenest-features", "version": str(FORMAT_VERSION)})
        atomic_write_bytes(self.root / "shards" / name, data)  # durable before the manifest names it
        append_jsonl_durable(self.manifest_path, rows)
        self.entries.extend(rows)
        self.done.update(r["id"] for r in rows)
        return len(data)

    def record_failures(self, rows: Iterable[dict]) -> None:
        rows = list(rows)
        if rows:
            append_jsonl_durable(self.root / "failures.jsonl", rows)


class FeatureStore:
    """Read-only view: `len(fs)`, `fs[i]` -> dict(id, input_ids, loss_mask, aux_hidden_states, last_hidden_state)."""

    def __init__(self, root: Path | str):
        self.root = Path(root)
        if not (self.root / "store.json").exists():
            raise EaglenestError(f"{self.root} is not a feature store (no store.json); run `eaglenest capture` first")
        self.meta = StoreMeta.from_dict(read_json(self.root / "store.json", "store metadata"))
        self.entries = read_jsonl_tolerant(self.root / "manifest.jsonl")
        self._handles: dict[str, object] = {}

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def n_tokens(self) -> int:
        return sum(e["n_tokens"] for e in self.entries)

    def ids(self) -> list[str]:
        return [e["id"] for e in self.entries]

    def lengths(self) -> list[int]:
        return [e["n_tokens"] for e in self.entries]

    def input_ids(self, i: int) -> torch.Tensor:
        """Sample i's token ids alone (int32 [T]; no hidden states read)."""
        return self._read(i, "input_ids")

    def loss_mask(self, i: int) -> torch.Tensor:
        """Sample i's loss mask alone (uint8 [T]; no hidden states read)."""
        return self._read(i, "loss_mask")

    def _read(self, i: int, name: str) -> torch.Tensor:
        e = self.entries[i]
        return self._open(e["shard"]).get_tensor(f"{e['key']}.{name}")

    def _open(self, shard: str):
        h = self._handles.get(shard)
        if h is None:
            path = self.root / "shards" / shard
            if not path.exists():
                raise EaglenestError(f"{path}: shard named in the manifest is missing (run `eaglenest features verify`)")
            h = safe_open(str(path), framework="pt")
            self._handles[shard] = h
        return h

    def load_tensors(self, i: int) -> dict[str, torch.Tensor]:
        e = self.entries[i]
        h = self._open(e["shard"])
        return {n: h.get_tensor(f"{e['key']}.{n}") for n in TENSORS}

    def __getitem__(self, i: int) -> dict:
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        t = self.load_tensors(i)
        return {
            "id": self.entries[i]["id"],
            "input_ids": t["input_ids"].long(),
            "loss_mask": t["loss_mask"].long(),
            "aux_hidden_states": t["aux_hidden_states"],
            "last_hidden_state": t["last_hidden_state"],
        }

    def verify(self) -> list[dict]:
        """Re-check every sample's checksum and shapes; returns the problems (id, shard, reason)."""
        problems = []
        for i, e in enumerate(self.entries):
            try:
                t = self.load_tensors(i)
            except EaglenestError as err:
                problems.append({"id": e["id"], "shard": e["shard"], "reason": str(err)})
                continue
            except Exception as err:  # truncated/garbled safetensors header or data
                problems.append({"id": e["id"], "shard": e["shard"], "reason": f"unreadable shard: {err}"})
                self._handles.pop(e["shard"], None)
                continue
            why = validate_sample(t, self.meta) if t["input_ids"].shape[0] == e["n_tokens"] else "token count differs from manifest"
            if why is None and sample_checksum(t) != e["sha256"]:
                why = "checksum mismatch"
            if why:
                problems.append({"id": e["id"], "shard": e["shard"], "reason": why})
        return problems

    def drop(self, ids: set[str]) -> None:
        """Remove samples from the manifest (their shards are deleted when no sample remains), so
        re-running capture re-creates exactly them."""
        keep = [e for e in self.entries if e["id"] not in ids]
        atomic_write_bytes(self.root / "manifest.jsonl", "".join(json.dumps(e, sort_keys=True) + "\n" for e in keep).encode())
        self._handles.clear()
        still = {e["shard"] for e in keep}
        for e in self.entries:
            if e["shard"] not in still:
                (self.root / "shards" / e["shard"]).unlink(missing_ok=True)
        self.entries = keep

    def bytes_on_disk(self) -> int:
        return sum(f.stat().st_size for f in (self.root / "shards").glob("*.safetensors"))


def estimate_bytes(n_tokens: int, hidden_size: int, dtype: str) -> int:
    """Disk needed for n_tokens: 3H aux + H final in `dtype`, plus ids (int32) and mask (uint8)."""
    per_tok = 4 * hidden_size * DTYPES[dtype].itemsize + 4 + 1
    return int(n_tokens * per_tok * 1.01) + 4096


def free_bytes(path: Path) -> int:
    p = Path(path)
    while not p.exists():
        p = p.parent
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize
