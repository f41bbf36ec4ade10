"""The on-disk layout of a prepared DATA_DIR: one writer and one reader.

Layout (format_version 1):
  data-00000.parquet, data-00001.parquet, ...   columns id (string), input_ids (list<int32>),
                                                 loss_mask (list<uint8>), in sample order
  token_counts.safetensors                       `counts`: int64 [vocab_size], ids under the loss mask
  meta.json                                      written last: a directory without it is incomplete

`PreparedWriter` / `write_prepared` are used by `prepare` and by any later stage that writes a new
DATA_DIR (regenerate), so there is exactly one writer of this layout.
"""

from __future__ import annotations

import bisect
import datetime as _dt
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from eaglenest import EaglenestError
from eaglenest.utils import atomic_write_bytes, atomic_write_json, read_json

FORMAT_VERSION = 1
META_FILE = "meta.json"
COUNTS_FILE = "token_counts.safetensors"
SHARD_GLOB = "data-*.parquet"
DEFAULT_SHARD_SIZE = 10000
# list<int32> uses int32 offsets: flush a shard early rather than overflow them
_MAX_SHARD_TOKENS = 1 << 30

# the canonical order of meta.json keys (anything else a caller adds goes after these)
_META_ORDER = (
    "format_version",
    "target",
    "tokenizer_fingerprint",
    "template_fingerprint",
    "vocab_size",
    "max_length",
    "n_samples",
    "n_tokens",
    "n_masked_tokens",
    "shards",
    "sources",
    "failures",
    "notes",
    "created",
)


def shard_name(index: int) -> str:
    return f"data-{index:05d}.parquet"


@dataclass
class Sample:
    """One training sequence: token ids and a 0/1 mask of the tokens the draft learns to predict."""

    id: str
    input_ids: list[int]
    loss_mask: list[int]


class PreparedWriter:
    """Stream samples into shards; `finish()` writes token counts and then meta.json.

    Opening a writer on an existing DATA_DIR removes its meta.json first (so a crash midway never
    leaves a directory that looks complete) and then its old shards and token counts.
    """

    def __init__(self, out_dir: Path | str, vocab_size: int, shard_size: int = DEFAULT_SHARD_SIZE) -> None:
        if vocab_size < 1:
            raise EaglenestError(f"vocab_size must be positive, got {vocab_size}")
        if shard_size < 1:
            raise EaglenestError(f"shard size must be positive, got {shard_size}")
        self.out_dir = Path(out_dir)
        if self.out_dir.exists() and not self.out_dir.is_dir():
            raise EaglenestError(f"output {self.out_dir} exists and is not a directory")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        _remove_previous_output(self.out_dir)
        self.vocab_size = vocab_size
        self.shard_size = shard_size
        self.counts = np.zeros(vocab_size, dtype=np.int64)
        self.shards: list[str] = []
        self.n_samples = 0
        self.n_tokens = 0
        self.n_masked_tokens = 0
        self._ids: set[str] = set()
        self._buf_ids: list[str] = []
        self._buf_tokens: list[np.ndarray] = []
        self._buf_masks: list[np.ndarray] = []
        self._buf_n_tokens = 0
        self._finished = False

    def add(self, sample: Sample) -> None:
        """Validate and buffer one sample (violations are caller bugs, so they raise)."""
        if self._finished:
            raise EaglenestError("PreparedWriter.add() after finish()")
        sid = sample.id
        if not isinstance(sid, str) or not sid:
            raise EaglenestError(f"sample id must be a non-empty string, got {sid!r}")
        if sid in self._ids:
            raise EaglenestError(f"duplicate sample id {sid!r}")
        ids = np.asarray(sample.input_ids, dtype=np.int64)
        mask = np.asarray(sample.loss_mask, dtype=np.int64)
        if ids.ndim != 1 or ids.size == 0 or mask.shape != ids.shape:
            raise EaglenestError(
                f"sample {sid!r}: input_ids and loss_mask must be non-empty 1-d lists of equal length "
                f"(got {ids.shape} and {mask.shape})"
            )
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise EaglenestError(f"sample {sid!r}: token id outside [0, {self.vocab_size})")
        if not np.isin(mask, (0, 1)).all():
            raise EaglenestError(f"sample {sid!r}: loss_mask values must be 0 or 1")
        if self._buf_ids and self._buf_n_tokens + ids.size > _MAX_SHARD_TOKENS:
            self._flush()
        self._ids.add(sid)
        self._buf_ids.append(sid)
        self._buf_tokens.append(ids.astype(np.int32))
        self._buf_masks.append(mask.astype(np.uint8))
        self._buf_n_tokens += ids.size
        if len(self._buf_ids) >= self.shard_size:
            self._flush()

    def _flush(self) -> None:
        if not self._buf_ids:
            return
        import pyarrow as pa
        import pyarrow.parquet as pq

        lengths = np.fromiter((t.size for t in self._buf_tokens), dtype=np.int64, count=len(self._buf_tokens))
        offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32), type=pa.int32())
        tokens = np.concatenate(self._buf_tokens)
        masks = np.concatenate(self._buf_masks)
        table = pa.table(
            {
                "id": pa.array(self._buf_ids, type=pa.string()),
                "input_ids": pa.ListArray.from_arrays(offsets, pa.array(tokens, type=pa.int32())),
                "loss_mask": pa.ListArray.from_arrays(offsets, pa.array(masks, type=pa.uint8())),
            }
        )
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
        name = shard_name(len(self.shards))
        atomic_write_bytes(self.out_dir / name, sink.getvalue().to_pybytes())
        # counts once per shard: a bincount per sample would cost O(vocab) each time
        self.counts += np.bincount(tokens[masks == 1], minlength=self.vocab_size)
        self.shards.append(name)
        self.n_samples += len(self._buf_ids)
        self.n_tokens += int(tokens.size)
        self.n_masked_tokens += int(masks.sum())
        self._buf_ids, self._buf_tokens, self._buf_masks, self._buf_n_tokens = [], [], [], 0

    def finish(self, meta_extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Flush the last shard, write token counts, then meta.json; return the meta dict."""
        import torch
        from safetensors.torch import save as save_safetensors

        self._flush()
        self._finished = True
        atomic_write_bytes(
            self.out_dir / COUNTS_FILE, save_safetensors({"counts": torch.from_numpy(self.counts.copy())})
        )
        computed = {
            "format_version": FORMAT_VERSION,
            "vocab_size": self.vocab_size,
            "n_samples": self.n_samples,
            "n_tokens": self.n_tokens,
            "n_masked_tokens": self.n_masked_tokens,
            "shards": list(self.shards),
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        }
        merged = {**(meta_extra or {}), **computed}
        meta = {k: merged[k] for k in _META_ORDER if k in merged}
        meta.update({k: v for k, v in merged.items() if k not in meta})
        atomic_write_json(self.out_dir / META_FILE, meta)
        return meta


def write_prepared(
    out_dir: Path | str,
    samples: Iterable[Sample],
    meta_extra: dict[str, Any],
    vocab_size: int,
    shard_size: int = DEFAULT_SHARD_SIZE,
) -> dict[str, Any]:
    """Write a complete DATA_DIR from `samples` (ids must be unique); returns the meta dict.

    `meta_extra` supplies the descriptive keys (target, tokenizer_fingerprint, template_fingerprint,
    max_length, sources, failures, notes, ...); counts, shards and `created` are computed here.
    """
    writer = PreparedWriter(out_dir, vocab_size, shard_size)
    for s in samples:
        writer.add(s)
    return writer.finish(meta_extra)


def _remove_previous_output(out_dir: Path) -> None:
    # meta.json first: from here on the directory no longer claims to be complete
    (out_dir / META_FILE).unlink(missing_ok=True)
    for p in out_dir.glob(SHARD_GLOB):
        p.unlink()
    (out_dir / COUNTS_FILE).unlink(missing_ok=True)


class PreparedData:
    """Read-only view of a prepared DATA_DIR.

    Iteration streams shards in file order; `d[i]` loads every shard's columns once, on first use.
    """

    def __init__(self, path: Path | str) -> None:
        import pyarrow.parquet as pq

        self.path = Path(path)
        meta_path = self.path / META_FILE
        if not meta_path.exists():
            raise EaglenestError(
                f"{self.path} is not a prepared data directory (no {META_FILE}; run `eaglenest prepare`)"
            )
        meta = read_json(meta_path, META_FILE)
        if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
            raise EaglenestError(f"{meta_path}: unsupported or missing format_version (expected {FORMAT_VERSION})")
        shards = meta.get("shards")
        if (
            not isinstance(shards, list)
            or not all(isinstance(s, str) for s in shards)
            or not isinstance(meta.get("n_samples"), int)
            or not isinstance(meta.get("vocab_size"), int)
        ):
            raise EaglenestError(f"{meta_path}: missing or malformed shards / n_samples / vocab_size")
        self.meta: dict[str, Any] = meta
        self._files = [self.path / s for s in shards]
        self._starts: list[int] = []
        total = 0
        for f in self._files:
            if not f.exists():
                raise EaglenestError(f"{self.path}: shard {f.name} listed in {META_FILE} is missing")
            self._starts.append(total)
            total += pq.read_metadata(f).num_rows  # footer only: cheap
        if total != meta["n_samples"]:
            raise EaglenestError(f"{self.path}: shards hold {total} rows but {META_FILE} says {meta['n_samples']}")
        self._tables: list | None = None

    def __len__(self) -> int:
        return int(self.meta["n_samples"])

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    def __iter__(self) -> Iterator[Sample]:
        import pyarrow.parquet as pq

        for f in self._files:
            for batch in pq.ParquetFile(f).iter_batches(batch_size=1024, columns=["id", "input_ids", "loss_mask"]):
                cols = batch.to_pydict()
                for sid, ids, mask in zip(cols["id"], cols["input_ids"], cols["loss_mask"]):
                    yield Sample(sid, ids, mask)

    def __getitem__(self, index: int) -> Sample:
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"sample index {index} out of range for {n} samples")
        if self._tables is None:
            import pyarrow.parquet as pq

            self._tables = [pq.read_table(f, columns=["id", "input_ids", "loss_mask"]) for f in self._files]
        k = bisect.bisect_right(self._starts, index) - 1
        row = self._tables[k].slice(index - self._starts[k], 1).to_pydict()
        return Sample(row["id"][0], row["input_ids"][0], row["loss_mask"][0])

    def ids(self) -> list[str]:
        import pyarrow.parquet as pq

        out: list[str] = []
        for f in self._files:
            out.extend(pq.read_table(f, columns=["id"]).column("id").to_pylist())
        return out

    def lengths(self) -> list[int]:
        """Tokens per sample, in sample order (list lengths only: no ids are converted)."""
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        out: list[int] = []
        for f in self._files:
            out.extend(pc.list_value_length(pq.read_table(f, columns=["input_ids"]).column("input_ids")).to_pylist())
        return out

    def token_counts(self):
        """int64 tensor [vocab_size]: how often each token id is under the loss mask."""
        from safetensors.torch import load_file

        path = self.path / COUNTS_FILE
        if not path.exists():
            raise EaglenestError(f"{self.path}: {COUNTS_FILE} is missing")
        counts = load_file(str(path)).get("counts")
        if counts is None or counts.ndim != 1 or counts.shape[0] != self.vocab_size:
            raise EaglenestError(f"{path}: expected an int64 tensor `counts` of length {self.vocab_size}")
        return counts.long()

    def __repr__(self) -> str:
        return f"PreparedData({str(self.path)!r}, n_samples={len(self)}, shards={len(self._files)})"
