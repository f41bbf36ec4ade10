"""The DATA_DIR writer and reader (no tokenizer needed)."""

from __future__ import annotations

import json

import pytest

from eaglenest import EaglenestError
from eaglenest.data import PreparedData, PreparedWriter, Sample, write_prepared

VOCAB = 50


def _samples(n: int) -> list[Sample]:
    return [Sample(f"s{i}", [i % VOCAB, (i + 1) % VOCAB, 7], [0, 1, 1]) for i in range(n)]


def test_roundtrip_with_shards(tmp_path):
    samples = _samples(5)
    meta = write_prepared(tmp_path / "d", samples, {"target": "t", "max_length": 8, "notes": {"x": 1}}, VOCAB, shard_size=2)
    assert meta["shards"] == ["data-00000.parquet", "data-00001.parquet", "data-00002.parquet"]
    assert (meta["n_samples"], meta["n_tokens"], meta["n_masked_tokens"]) == (5, 15, 10)
    assert meta["format_version"] == 1 and meta["target"] == "t" and meta["notes"] == {"x": 1}
    assert list(meta)[:2] == ["format_version", "target"]

    d = PreparedData(tmp_path / "d")
    assert len(d) == 5 and d.meta == json.loads((tmp_path / "d" / "meta.json").read_text())
    assert list(d) == samples
    assert [d[i] for i in range(5)] == samples
    assert d[-1] == samples[-1]
    with pytest.raises(IndexError):
        d[5]
    assert d.ids() == [s.id for s in samples]
    counts = d.token_counts()
    assert counts.dtype.is_floating_point is False and counts.shape == (VOCAB,)
    expected = [0] * VOCAB
    for s in samples:
        for t, m in zip(s.input_ids, s.loss_mask):
            expected[t] += m
    assert counts.tolist() == expected


def test_rewrite_removes_stale_shards(tmp_path):
    write_prepared(tmp_path, _samples(6), {}, VOCAB, shard_size=2)
    write_prepared(tmp_path, _samples(1), {}, VOCAB, shard_size=2)
    assert sorted(p.name for p in tmp_path.glob("data-*.parquet")) == ["data-00000.parquet"]
    assert len(PreparedData(tmp_path)) == 1


def test_writer_rejects_bad_samples(tmp_path):
    w = PreparedWriter(tmp_path, VOCAB)
    w.add(Sample("a", [1], [1]))
    for bad in (
        Sample("a", [1], [1]),  # duplicate id
        Sample("b", [1, 2], [1]),  # lengths differ
        Sample("c", [VOCAB], [1]),  # outside the vocabulary
        Sample("d", [1], [2]),  # mask not 0/1
        Sample("e", [], []),  # empty
    ):
        with pytest.raises(EaglenestError):
            w.add(bad)


def test_reader_errors(tmp_path):
    with pytest.raises(EaglenestError, match="meta.json"):
        PreparedData(tmp_path)
    (tmp_path / "meta.json").write_text("{not json")
    with pytest.raises(EaglenestError, match="not valid JSON"):
        PreparedData(tmp_path)
    write_prepared(tmp_path, _samples(3), {}, VOCAB, shard_size=2)
    (tmp_path / "data-00001.parquet").unlink()
    with pytest.raises(EaglenestError, match="missing"):
        PreparedData(tmp_path)
