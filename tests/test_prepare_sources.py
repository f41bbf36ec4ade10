"""Input readers: the streaming JSON array reader across chunk boundaries, and edge formats."""

from __future__ import annotations

import json

import pytest

from eaglenest import EaglenestError
from eaglenest.data import sources
from eaglenest.data.sources import Source, iter_items, resolve_sources


def items(path, **kw):
    return [(it.line, it.value, it.error[0] if it.error else None) for it in iter_items(Source(path, str(path), **kw))]


@pytest.mark.parametrize("chunk", [1, 7, 64, 1 << 20])
def test_array_reader_matches_json_loads_at_any_chunk_size(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(sources, "_CHUNK", chunk)
    data = [{"id": i, "text": "é☕\n" * i, "n": [1.5, None, True]} for i in range(12)] + [7, "x"]
    f = tmp_path / "a.json"
    text = json.dumps(data, indent=1, ensure_ascii=False)
    f.write_text(text)
    got = items(f)
    assert [v for _, v, _ in got] == data and all(e is None for *_, e in got)
    # with indent=1 every top-level item starts on a line indented by exactly one space
    starts = [i + 1 for i, line in enumerate(text.splitlines()) if line.startswith(" ") and line[1] not in " }"]
    assert [line for line, _, _ in got] == starts


def test_array_edge_cases(tmp_path):
    f = tmp_path / "a.json"
    f.write_bytes(b"\xef\xbb\xbf  [ ]  ")
    assert items(f) == []
    f.write_text('[{"a": 1}, {"a": 2}')
    assert [e for *_, e in items(f)] == [None, None, "malformed_json"]
    f.write_text('[{"a": 1}] trailing')
    assert [e for *_, e in items(f)] == [None, "malformed_json"]
    f.write_text('[{"a": 1} {"a": 2}]')
    assert [e for *_, e in items(f)] == [None, "malformed_json"]


def test_json_file_that_is_not_an_array_is_read_as_jsonl(tmp_path):
    f = tmp_path / "a.json"
    f.write_text('{"a": 1}\n\n{"a": 2}\n')
    assert items(f) == [(1, {"a": 1}, None), (3, {"a": 2}, None)]


def test_max_items(tmp_path):
    f = tmp_path / "a.jsonl"
    f.write_text("".join(json.dumps({"i": i}) + "\n" for i in range(10)))
    assert [v["i"] for _, v, _ in items(f, max_items=3)] == [0, 1, 2]


def test_resolve_sources_errors(tmp_path):
    with pytest.raises(EaglenestError, match="input file not found: .*nope"):
        resolve_sources([str(tmp_path / "nope")])
    with pytest.raises(EaglenestError, match="sharegpt:N"):
        resolve_sources(["sharegpt:abc"])
    with pytest.raises(EaglenestError, match="not a file"):
        resolve_sources([str(tmp_path)])
    (src,) = resolve_sources(["sharegpt:10"])
    assert src.max_items == 10 and src.path.name == "ShareGPT_V3_unfiltered_cleaned_split.json"
    assert src.stem == "ShareGPT_V3_unfiltered_cleaned_split"
