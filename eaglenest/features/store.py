"""The feature store: safetensors shards + an append-only manifest with per-sample checksums.

Layout of FEAT_DIR:
    store.json        metadata written once at creation (target, layer ids, convention, final-norm
                      flag, dtype, the target's compute dtype, hidden size); a re-run must match
                      it or fail loudly (see "Compute dtype" below)
    shards/NNNNNN-<rand>.safetensors
                      one file per capture batch; sample k's tensors are named
                      `k.input_ids` (int32 [T]), `k.loss_mask` (uint8 [T]),
                      `k.aux_hidden_states` ([T, n*H], n = len(layer_ids): the captured
                      layers' states concatenated in order), `k.last_hidden_state` ([T, H]);
                      in an fp8 store a state is float8 e4m3 codes plus `<name>_exp` (int8
                      [T, values / block]): value = code * 2**exp, one power-of-two scale per
                      `fp8_block` consecutive values of a row (see "Store dtypes" below)
    manifest.jsonl    one line per stored sample: {id, shard, key, n_tokens, sha256};
                      appended (and fsynced) only after its shard is durable on disk
    failures.jsonl    samples that failed capture, with reasons (retried on the next run)

Durability: a shard is written to a temp name, fsynced and renamed, *then* its manifest lines are
appended.  A kill at any point leaves either a complete sample or nothing (an orphan shard that
the next run deletes); the manifest is the only source of truth, so there are never duplicates.

Store dtypes (`store.json: dtype`): bf16 / fp16 / fp32 keep both states as captured; fp8 keeps both
in float8 e4m3 (half the bytes), fp8-aux only the aux states (the final state, which feeds the
teacher's logits, stays bf16).  Scales are powers of two: they only move e4m3's exponent range
(its relative precision is the same at any scale), and decoding is then exact in bf16 and a few
integer operations (fast on a CPU: see fp8_decode).  Readers always get the decoded
bf16 tensors; verify/convert/merge work on the stored ones.

Compute dtype (`store.json: compute_dtype`): the dtype the target computed the states in, which
the store dtype does not say: `capture --dtype auto` computes in bf16 on a CPU with bf16 matrix
instructions and in fp32 on one without (utils.auto_dtype), storing bf16 either way.  A resume or a
merge that would put states of both under one store.json is refused.  A store without the field
(written before it existed, or captured from a server eaglenest did not start) does not record it:
it reads as before, takes a resume of any compute dtype (with a warning: mixing cannot be ruled
out there) and keeps not recording it; a merge with such a store does not record it either.

The fp8 scheme (`store.json: fp8_block`) is how many consecutive values of a layer share one scale:
by default the largest divisor of the hidden size <= 128 (FP8_BLOCK; a block never straddles two
layers), 1 int8 exponent per 128 codes = 0.8 % more bytes.  One scale per (token, layer) -- block =
hidden size, what fp8 stores held before this field existed (they have no `fp8_block`, and read as
that) -- flushes every value below ~absmax * 2**-14 to zero, and targets with massive activations
(a few channels 10^3-10^4 times the rest) lose most of a layer's channels on the tokens that carry
them: measured by the retired probe store_outliers
(git show afe579c:bench/results/store_outliers.json).
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np
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
STATES = ("aux_hidden_states", "last_hidden_state")  # the hidden states a sample holds (state_layers: how wide)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
# store dtype -> how (aux, final) are kept; "fp8" = e4m3 codes + one int8 exponent per fp8_block values
STORE_DTYPES = {
    "bf16": ("bf16", "bf16"),
    "fp16": ("fp16", "fp16"),
    "fp32": ("fp32", "fp32"),
    "fp8": ("fp8", "fp8"),
    "fp8-aux": ("fp8", "bf16"),
}
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_BLOCK = 128  # default: at most this many values share one scale (DeepSeek-V3's fp8 activation tiles are 1 x 128)
# metadata fields that must agree between a store and the run that appends to it
IDENTITY_KEYS = ("target_fingerprint", "hidden_size", "num_layers", "layer_ids", "convention", "final_norm", "dtype", "fp8_block",
                 "compute_dtype")


def is_fp8(dtype: str) -> bool:
    return "fp8" in STORE_DTYPES[dtype]


def fp8_block_for(hidden_size: int, block: int = FP8_BLOCK) -> int:
    """Values per scale for `--fp8-block block`: the largest divisor of the hidden size <= block, so
    that blocks tile every layer (and a decoder needs only the shapes); 0 = the whole layer, one
    scale per (token, layer) (the scheme of fp8 stores written before `fp8_block` existed)."""
    if block < 0:
        raise EaglenestError(f"--fp8-block must be >= 0 (got {block})")
    if block == 0 or block >= hidden_size:
        return hidden_size
    return max(d for d in range(1, block + 1) if hidden_size % d == 0)


def describe_scheme(dtype: str, fp8_block: int | None, hidden_size: int) -> str:
    """How a store keeps its states, in words (plans, stats, errors)."""
    if not is_fp8(dtype):
        return dtype
    scale = "one scale per token and layer" if fp8_block in (None, hidden_size) else f"one scale per {fp8_block} values"
    return f"{dtype} (e4m3, {scale})"


def state_layers(aux_layers: int) -> dict[str, int]:
    """state -> how many H-wide layer states it concatenates: the aux states one per captured layer
    (`aux_layers` = len(store.json layer_ids); 3 for EAGLE-3, any count for DFlash), the final one."""
    return {"aux_hidden_states": int(aux_layers), "last_hidden_state": 1}


@dataclass
class StoreMeta:
    target: str
    target_fingerprint: str
    hidden_size: int
    num_layers: int
    layer_ids: list[int]  # capture-before convention
    final_norm: str  # "post": last_hidden_state is after the final norm; "pre": before it
    dtype: str  # a STORE_DTYPES key: bf16 | fp32 | fp16 | fp8 | fp8-aux
    engine: str
    convention: str = "capture-before"
    vocab_size: int | None = None
    format_version: int = FORMAT_VERSION
    # fp8 stores: values per scale (fp8_block_for; None: its default); None for the others.  In
    # store.json only when finer than a layer: a store without it has one scale per (token, layer),
    # as every fp8 store had before the field existed (so their store.json and fingerprints stay)
    fp8_block: int | None = None
    # the target's compute dtype (bf16 | fp32 | fp16); None: not recorded (module doc, "Compute dtype"),
    # and then left out of store.json, as stores written before the field have it
    compute_dtype: str | None = None

    def __post_init__(self):
        if self.dtype in STORE_DTYPES and is_fp8(self.dtype):
            if self.fp8_block is None:
                self.fp8_block = fp8_block_for(self.hidden_size)
            elif self.fp8_block <= 0 or self.hidden_size % self.fp8_block:
                raise EaglenestError(f"fp8_block {self.fp8_block} does not divide the hidden size {self.hidden_size}")
        else:
            self.fp8_block = None

    @property
    def aux_layers(self) -> int:
        """How many layers the aux states concatenate (stores of any age: read from layer_ids)."""
        return len(self.layer_ids)

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        if d["fp8_block"] in (None, self.hidden_size):
            del d["fp8_block"]
        if d["compute_dtype"] is None:
            del d["compute_dtype"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "StoreMeta":
        """A store.json (or to_dict's output) -> StoreMeta; an fp8 store without `fp8_block` has one
        scale per (token, layer).  For another dtype or scheme of a store use `with_scheme`."""
        kw = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        if kw.get("fp8_block") is None and "hidden_size" in d:
            kw["fp8_block"] = d["hidden_size"]  # dropped again (None) unless the dtype is fp8
        return cls(**kw)

    def identity(self) -> dict:
        """The IDENTITY_KEYS fields (fp8_block named even where store.json omits it)."""
        return {k: getattr(self, k) for k in IDENTITY_KEYS}

    def with_scheme(self, dtype: str, fp8_block: int = FP8_BLOCK) -> "StoreMeta":
        """This store's metadata for another store dtype (convert); fp8_block as `--fp8-block`."""
        return StoreMeta.from_dict({**self.to_dict(), "dtype": dtype,
                                    "fp8_block": fp8_block_for(self.hidden_size, fp8_block) if is_fp8(dtype) else None})

    @property
    def scheme(self) -> str:
        return describe_scheme(self.dtype, self.fp8_block, self.hidden_size)


def stored_names(dtype: str) -> tuple[str, ...]:
    """The tensors a sample keeps on disk, in checksum order (bf16 stores: exactly TENSORS)."""
    enc = dict(zip(STATES, STORE_DTYPES[dtype]))
    return tuple(x for n in TENSORS for x in ((n, f"{n}_exp") if enc.get(n) == "fp8" else (n,)))


def sample_checksum(tensors: dict[str, torch.Tensor], dtype: str = "bf16") -> str:
    """sha256 over the raw bytes of the sample's stored tensors in a fixed order."""
    return sha256_bytes(*(tensors[n].contiguous().view(torch.uint8).numpy().tobytes() for n in stored_names(dtype)))


def fp8_encode(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, W] -> (e4m3 codes [T, W], int8 exponents [T, W / block]) with x ~= code * 2**exp, one
    exponent per `block` consecutive values of a row (block divides W).  The exponent puts each
    block's absmax in (224, 448]; codes that would be e4m3 subnormals (below ~absmax / 2**14) are
    written as zero, so the decoder needs no special case."""
    T, W = x.shape
    if W % block:
        raise EaglenestError(f"fp8 block {block} does not divide the row width {W}")
    v = x.float().view(T, W // block, block)
    amax = v.abs().amax(-1)
    exp = torch.ceil(torch.log2(amax / FP8_MAX)).clamp_(-119, 119).nan_to_num_(0.0)  # log2(0) = -inf -> -119
    y = (v * torch.exp2(-exp)[:, :, None]).clamp_(-FP8_MAX, FP8_MAX)  # exact: a power of two
    b = y.to(torch.float8_e4m3fn).view(torch.uint8)
    b = torch.where((b & 0x78) == 0, b & 0x80, b)  # exponent field 0: +-0 or a subnormal -> +-0
    return b.view(torch.float8_e4m3fn).view(x.shape), exp.to(torch.int8)


def fp8_decode(codes: torch.Tensor, exp: torch.Tensor) -> torch.Tensor:
    """(e4m3 codes [T, W], int8 exponents [T, W / block]) -> bf16 [T, W], exactly code * 2**exp; the
    block is read off the shapes (any scheme: one block per layer or finer ones).  Bit arithmetic on
    int16: bf16 = sign | (e4m3 exponent+mantissa << 4) + (120 + exp) << 7, with +-0 kept zero; a few rows at a time so the temporaries stay in cache.  Several times faster on
    a CPU core than torch's own fp8 -> bf16 cast, which would be a loader worker's whole budget."""
    T, L = exp.shape  # L: blocks per row
    c = codes.contiguous().view(torch.int8).numpy().reshape(T, L, codes.shape[1] // L)  # int8: the sign bit sign-extends
    off = ((120 + exp.numpy().astype(np.int16)) << 7)[:, :, None]
    out = np.empty(c.shape, dtype=np.int16)
    rows = max(1, 2**17 // max(1, codes.shape[1]))
    a = np.empty((min(rows, T),) + c.shape[1:], dtype=np.int16)
    nz = np.empty(a.shape, dtype=bool)
    for s in range(0, T, rows):
        n = min(rows, T - s)
        aa, r, z = a[:n], out[s : s + n], nz[:n]
        aa[...] = c[s : s + n]
        np.bitwise_and(aa, 0x7F, out=r)
        np.not_equal(r, 0, out=z)
        r <<= 4
        r += off[s : s + n]
        r *= z
        aa &= -32768  # the sign bit
        r |= aa
    return torch.from_numpy(out.reshape(codes.shape)).view(torch.bfloat16)


def encode_sample(t: dict[str, torch.Tensor], dtype: str, fp8_block: int | None = None) -> dict[str, torch.Tensor]:
    """A captured sample's tensors -> what the store keeps (stored_names(dtype)); fp8 states with
    one scale per `fp8_block` values (the store's StoreMeta.fp8_block; blocks tile every layer, so
    any number of aux layers encodes the same way)."""
    out = {"input_ids": t["input_ids"].to(torch.int32).cpu().contiguous(), "loss_mask": t["loss_mask"].to(torch.uint8).cpu().contiguous()}
    for name, enc in zip(STATES, STORE_DTYPES[dtype]):
        x = t[name].cpu()
        if enc == "fp8":
            if fp8_block is None:
                raise EaglenestError("an fp8 store needs its fp8_block (StoreMeta.fp8_block)")
            out[name], out[f"{name}_exp"] = fp8_encode(x, fp8_block)
        else:
            out[name] = x.to(DTYPES[enc]).contiguous()
    return out


def decode_sample(raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stored tensors -> the four TENSORS (fp8 states as exact bf16)."""
    return {n: fp8_decode(raw[n], raw[f"{n}_exp"]) if f"{n}_exp" in raw else raw[n] for n in TENSORS if n in raw}


def validate_sample(t: dict[str, torch.Tensor], meta: StoreMeta) -> str | None:
    """Return why a captured (or decoded) sample is unusable, or None."""
    T = t["input_ids"].shape[0]
    H = meta.hidden_size
    layers = state_layers(meta.aux_layers)
    expect = {"input_ids": (T,), "loss_mask": (T,), **{n: (T, k * H) for n, k in layers.items()}}
    expect.update({f"{n}_exp": (T, k * H // (meta.fp8_block or H)) for n, k in layers.items() if f"{n}_exp" in t})
    for name, shape in expect.items():
        if tuple(t[name].shape) != shape:
            return f"bad_shape: {name} {tuple(t[name].shape)} != {shape}"
    for name in STATES:
        x = t[name]
        if x.dtype == torch.float8_e4m3fn:  # e4m3fn has no Inf; NaN is the code x1111111
            bad = bool(((x.view(torch.uint8) & 0x7F) == 0x7F).any())
        else:
            bad = not bool(torch.isfinite(x).all())
        if bad:
            return f"non_finite: {name} has NaN/Inf"
    return None


class FeatureWriter:
    """Appends captured samples to a store; safe to kill at any moment and re-open to resume."""

    def __init__(self, root: Path | str, meta: StoreMeta):
        self.root = Path(root)
        self.meta = meta
        if meta.dtype not in STORE_DTYPES:
            raise EaglenestError(f"unknown store dtype {meta.dtype!r} (one of: {', '.join(STORE_DTYPES)})")
        (self.root / "shards").mkdir(parents=True, exist_ok=True)
        existing = self.root / "store.json"
        if existing.exists():
            old, new = read_json(existing, "store metadata"), meta.identity()
            if old.get("dtype") in STORE_DTYPES and is_fp8(old["dtype"]):
                old.setdefault("fp8_block", old.get("hidden_size"))  # as from_dict reads it
            unrecorded = old.get("compute_dtype") is None  # takes any run's (module doc, "Compute dtype")
            diff = [k for k in IDENTITY_KEYS if old.get(k) != new.get(k) and not (k == "compute_dtype" and unrecorded)]
            if diff:
                details = ", ".join(f"{k}: store has {old.get(k)!r}, this run {new.get(k)!r}" for k in diff)
                if "compute_dtype" in diff and old["compute_dtype"] in DTYPES:
                    details += (f"; the target computed its states in {old['compute_dtype']} (capture --dtype auto picks "
                                f"by CPU): resume with --dtype {old['compute_dtype']}")
                raise EaglenestError(f"{self.root} holds features from a different setup ({details}); use another --out")
            if unrecorded and meta.compute_dtype is not None:
                print(f"warning: {existing} does not record the dtype its states were computed in (written before "
                      f"eaglenest recorded it, or from a server given by URL): this run computes in {meta.compute_dtype}, "
                      "and a mix cannot be ruled out", file=sys.stderr)
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

    def write_batch(self, samples: list[tuple[str, dict[str, torch.Tensor]]], encoded: bool = False) -> int:
        """Write one shard with these (id, tensors) samples; returns the bytes written.
        `encoded`: the tensors are already in this store's stored form (convert/merge)."""
        samples = [(sid, t) for sid, t in samples if sid not in self.done]
        if not samples:
            return 0
        tensors, rows = {}, []
        name = f"{len(self.entries):09d}-{secrets.token_hex(4)}.safetensors"
        for k, (sid, t) in enumerate(samples):
            t = t if encoded else encode_sample(t, self.meta.dtype, self.meta.fp8_block)
            for n in stored_names(self.meta.dtype):
                tensors[f"{k}.{n}"] = t[n]
            rows.append({"id": sid, "shard": name, "key": str(k), "n_tokens": int(t["input_ids"].shape[0]),
                         "sha256": sample_checksum(t, self.meta.dtype)})
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


class Shard:
    """One open shard.  `get_tensor(name)` returns what readers consume (fp8 states decoded to
    bf16), so every read path -- collate, prefetching workers, `fs[i]` -- gets the same values;
    `get_stored(name)` returns the bytes as kept (checksums, convert, merge)."""

    def __init__(self, path: Path):
        self._h = safe_open(str(path), framework="pt")

    def get_stored(self, name: str) -> torch.Tensor:
        return self._h.get_tensor(name)

    def get_tensor(self, name: str) -> torch.Tensor:
        x = self._h.get_tensor(name)
        if x.dtype == torch.float8_e4m3fn:
            return fp8_decode(x, self._h.get_tensor(f"{name}_exp"))
        return x


class FeatureStore:
    """Read-only view: `len(fs)`, `fs[i]` -> dict(id, input_ids, loss_mask, aux_hidden_states, last_hidden_state);
    the states come back as captured (bf16/fp16/fp32 stores) or decoded to bf16 (fp8 stores)."""

    def __init__(self, root: Path | str):
        self.root = Path(root)
        if not (self.root / "store.json").exists():
            raise EaglenestError(f"{self.root} is not a feature store (no store.json); run `eaglenest capture` first")
        self.meta = StoreMeta.from_dict(read_json(self.root / "store.json", "store metadata"))
        if self.meta.dtype not in STORE_DTYPES:
            raise EaglenestError(f"{self.root}/store.json: unknown store dtype {self.meta.dtype!r} (one of: {', '.join(STORE_DTYPES)})")
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
            h = Shard(path)
            self._handles[shard] = h
        return h

    def load_tensors(self, i: int) -> dict[str, torch.Tensor]:
        """Sample i's four TENSORS as readers get them (decoded)."""
        e = self.entries[i]
        h = self._open(e["shard"])
        return {n: h.get_tensor(f"{e['key']}.{n}") for n in TENSORS}

    def load_stored(self, i: int) -> dict[str, torch.Tensor]:
        """Sample i's tensors as kept on disk (stored_names of the store's dtype)."""
        e = self.entries[i]
        h = self._open(e["shard"])
        return {n: h.get_stored(f"{e['key']}.{n}") for n in stored_names(self.meta.dtype)}

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
                t = self.load_stored(i)
            except EaglenestError as err:
                problems.append({"id": e["id"], "shard": e["shard"], "reason": str(err)})
                continue
            except Exception as err:  # truncated/garbled safetensors header or data
                problems.append({"id": e["id"], "shard": e["shard"], "reason": f"unreadable shard: {err}"})
                self._handles.pop(e["shard"], None)
                continue
            why = validate_sample(t, self.meta) if t["input_ids"].shape[0] == e["n_tokens"] else "token count differs from manifest"
            if why is None and sample_checksum(t, self.meta.dtype) != e["sha256"]:
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


def bytes_per_token(hidden_size: int, dtype: str, *, fp8_block: int | None = None, aux_layers: int = 3) -> int:
    """Stored bytes per token: n*H aux (n = aux_layers; EAGLE-3's 3 by default) + H final (+ one
    int8 exponent per fp8_block values in fp8; None = the default block, fp8_block_for(hidden_size)),
    ids (int32), mask (uint8)."""
    block = fp8_block or fp8_block_for(hidden_size)
    n = 4 + 1
    for layers, enc in zip(state_layers(aux_layers).values(), STORE_DTYPES[dtype]):
        n += layers * hidden_size * (1 if enc == "fp8" else DTYPES[enc].itemsize) + (layers * hidden_size // block if enc == "fp8" else 0)
    return n


def estimate_bytes(n_tokens: int, hidden_size: int, dtype: str, *, fp8_block: int | None = None, aux_layers: int = 3) -> int:
    """Disk needed for n_tokens (1 % for safetensors headers and the manifest)."""
    return int(n_tokens * bytes_per_token(hidden_size, dtype, fp8_block=fp8_block, aux_layers=aux_layers) * 1.01) + 4096


def free_bytes(path: Path) -> int:
    p = Path(path)
    while not p.exists():
        p = p.parent
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize
