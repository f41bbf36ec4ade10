"""`prepare`: conversations -> token ids + loss masks in a DATA_DIR (see store.py for the layout)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eaglenest import EaglenestError
from eaglenest.data.chat import ChatEncoder
from eaglenest.data.rows import FORMATS, ItemError, check_token_range, clean_id, parse_row, row_id
from eaglenest.data.sources import Source, iter_items, resolve_sources
from eaglenest.data.store import DEFAULT_SHARD_SIZE, PreparedWriter, Sample
from eaglenest.utils import Failures, progress

ON_OVERLENGTH = ("truncate", "drop")


class _Ids:
    """Unique sample ids: a repeated id gets `#2`, `#3`, ... (counted, not a failure)."""

    def __init__(self) -> None:
        self.used: set[str] = set()
        self.last_suffix: dict[str, int] = {}
        self.renamed = 0

    def claim(self, base: str) -> str:
        if base not in self.used:
            self.used.add(base)
            return base
        k = self.last_suffix.get(base, 1)
        while True:
            k += 1
            candidate = f"{base}#{k}"
            if candidate not in self.used:
                break
        self.last_suffix[base] = k
        self.used.add(candidate)
        self.renamed += 1
        return candidate


def prepare(
    *,
    model: str | Path,
    data: list[str | Path],
    out: str | Path,
    format: str = "auto",
    max_length: int = 2048,
    on_overlength: str = "truncate",
    strict: bool = False,
    limit: int | None = None,
    shard_size: int = DEFAULT_SHARD_SIZE,
    trust_remote_code: bool = False,
    tokenizer: Any = None,
    verbose: bool = True,
    loss_on: str = "all",
) -> dict[str, Any]:
    """Tokenize `data` with the target's chat template into `out`; returns the meta dict.

    `tokenizer` overrides the one loaded from `model` (tests use it to try other chat templates).
    """
    from eaglenest.models.target import load_tokenizer, resolve_model_path, template_fingerprint, tokenizer_fingerprint

    if format not in FORMATS:
        raise EaglenestError(f"unknown --format {format!r} (one of {', '.join(FORMATS)})")
    if on_overlength not in ON_OVERLENGTH:
        raise EaglenestError(f"unknown --on-overlength {on_overlength!r} (one of {', '.join(ON_OVERLENGTH)})")
    for name, v in (("--max-length", max_length), ("--shard-size", shard_size), ("--limit", limit)):
        if v is not None and v < 1:
            raise EaglenestError(f"{name} must be at least 1, got {v}")
    sources = resolve_sources([str(d) for d in data])  # fail on a missing file before any work
    model_path = resolve_model_path(model)
    tok = tokenizer if tokenizer is not None else load_tokenizer(model_path, trust_remote_code)
    encoder = ChatEncoder(tok, loss_on=loss_on)
    vocab_size = len(tok)

    failures = Failures(strict=strict)
    ids = _Ids()
    writer = PreparedWriter(out, vocab_size, shard_size)
    n_ok = 0
    n_truncated = 0
    source_meta: list[dict[str, Any]] = []
    total = sum(s.max_items for s in sources) if all(s.max_items for s in sources) else None
    bar = progress(total=total, desc="prepare", unit="item")
    try:
        for src in sources:
            stats: dict[str, Any] = {"path": str(src.path), "format": format, "n_read": 0, "n_ok": 0}
            source_meta.append(stats)
            detected: set[str] = set()
            for item in iter_items(src):
                if limit is not None and n_ok >= limit:
                    break
                stats["n_read"] += 1
                bar.update(1)
                where = f"{_display(src)}:{item.line}"
                try:
                    if item.error is not None:
                        raise ItemError(*item.error)
                    row = parse_row(item.value, format)
                    detected.add(row.format)
                    if row.format == "tokens":
                        assert row.input_ids is not None and row.loss_mask is not None
                        check_token_range(row.input_ids, vocab_size)
                        input_ids, loss_mask = row.input_ids, row.loss_mask
                    else:
                        assert row.messages is not None
                        input_ids, loss_mask = encoder.encode(row.messages)
                    truncated = False
                    if len(input_ids) > max_length:
                        if on_overlength == "drop":
                            raise ItemError("overlength", f"{len(input_ids)} tokens > --max-length {max_length}")
                        input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
                        if not any(loss_mask):
                            raise ItemError(
                                "no_assistant_after_truncation",
                                f"no assistant token left in the first {max_length} tokens",
                            )
                        truncated = True
                except ItemError as e:
                    failures.record(e.reason, e.message, where=where, sample_id=row_id(item.value))
                    continue
                sid = ids.claim(row.id or clean_id(f"{src.stem}:{item.line}"))
                writer.add(Sample(sid, input_ids, loss_mask))
                n_ok += 1
                stats["n_ok"] += 1
                n_truncated += truncated
            if format == "auto":
                stats["format"] = "+".join(sorted(detected)) or "auto"
            if limit is not None and n_ok >= limit:
                break
    finally:
        bar.close()

    if n_ok == 0:
        inputs = ", ".join(s.spec for s in sources)
        raise EaglenestError(f"no usable samples in {inputs}: {failures.format('items')}")
    meta = writer.finish(
        {
            "target": str(model_path),
            "tokenizer_fingerprint": tokenizer_fingerprint(tok),
            "template_fingerprint": template_fingerprint(tok),
            "max_length": max_length,
            "loss_on": loss_on,
            "sources": source_meta,
            "failures": failures.summary(),
            "notes": {
                "duplicate_id_renamed": ids.renamed,
                "truncated": n_truncated,
                "end_of_turn_tokens": dict(encoder.end_of_turn_tokens),
                "turns_with_reasoning_masked": encoder.reasoning_turns,
            },
        }
    )
    if verbose:
        _print_summary(meta, failures, Path(out))
    return meta


def _display(src: Source) -> str:
    # user files as typed; the built-in source by its real file, so file:line can be opened
    return str(src.path) if src.spec.startswith("sharegpt") else src.spec


def _print_summary(meta: dict[str, Any], failures: Failures, out: Path) -> None:
    notes = meta["notes"]
    print(
        f"prepared {meta['n_samples']} samples: {meta['n_tokens']} tokens, "
        f"{meta['n_masked_tokens']} under the loss mask, {len(meta['shards'])} shard(s) -> {out}"
    )
    for s in meta["sources"]:
        print(f"  {s['path']} ({s['format']}): {s['n_ok']} of {s['n_read']} items used")
    print(failures.format("items"))
    if notes["truncated"] or notes["duplicate_id_renamed"]:
        print(f"truncated to --max-length: {notes['truncated']}, duplicate ids renamed: {notes['duplicate_id_renamed']}")
