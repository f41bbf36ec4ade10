"""`prepare` on bad input: every bad item is counted under its reason with file:line, good rows
survive, --strict stops at the first one; plus the CLI end to end (real SmolLM2 tokenizer only)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from eaglenest import EaglenestError
from eaglenest.data import PreparedData, prepare


def conv(text: str = "Hi", answer: str = "Hello!", id: str | int | None = None) -> dict:
    row: dict = {"conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": answer}]}
    if id is not None:
        row["id"] = id
    return row


def jsonl(path: Path, rows: list) -> Path:
    """rows: dicts/lists are dumped, str/bytes written as the raw line."""
    out = b""
    for r in rows:
        if isinstance(r, bytes):
            out += r + b"\n"
        elif isinstance(r, str):
            out += r.encode() + b"\n"
        else:
            out += json.dumps(r).encode() + b"\n"
    path.write_bytes(out)
    return path


@pytest.fixture(scope="module")
def tok(smollm2):
    from eaglenest.models.target import load_tokenizer

    return load_tokenizer(smollm2)


@pytest.fixture
def run(tmp_path, smollm2, tok):
    def _run(*files: Path, **kw):
        kw.setdefault("out", tmp_path / "out")
        return prepare(model=smollm2, data=list(files), tokenizer=tok, verbose=False, **kw)

    return _run


def reasons(meta: dict) -> dict:
    return meta["failures"]["by_reason"]


def where(meta: dict, reason: str) -> list[str]:
    return [e["where"] for e in meta["failures"]["examples"] if e["reason"] == reason]


def test_malformed_json_line(tmp_path, run, capsys):
    f = jsonl(tmp_path / "a.jsonl", [conv(id="g1"), '{"id": "bad", "conversations": [', conv(id="g2")])
    meta = run(f)
    assert reasons(meta) == {"malformed_json": 1}
    assert where(meta, "malformed_json") == [f"{f}:2"]
    assert f"{f}:2" in capsys.readouterr().err
    assert PreparedData(tmp_path / "out").ids() == ["g1", "g2"]


def test_truncated_json_array_keeps_complete_items(tmp_path, run):
    items = [conv(id=f"g{i}") for i in range(3)]
    text = json.dumps(items, indent=2)
    cut = text.rindex('"gpt"')  # inside the last item
    f = tmp_path / "a.json"
    f.write_text(text[:cut])
    meta = run(f)
    assert meta["n_samples"] == 2 and reasons(meta) == {"malformed_json": 1}
    third_item_line = [i + 1 for i, line in enumerate(text.splitlines()) if line == "  {"][2]  # its opening brace
    assert where(meta, "malformed_json") == [f"{f}:{third_item_line}"]
    assert meta["sources"][0] | {"path": None} == {"path": None, "format": "sharegpt", "n_read": 3, "n_ok": 2}


def test_json_array_line_numbers_and_missing_ids(tmp_path, run):
    f = tmp_path / "b.json"
    f.write_text(json.dumps([conv(), {"id": "x"}, conv()], indent=2))
    meta = run(f)
    lines = [i + 1 for i, line in enumerate(f.read_text().splitlines()) if line == "  {"]
    assert where(meta, "missing_field") == [f"{f}:{lines[1]}"]
    assert PreparedData(tmp_path / "out").ids() == [f"b:{lines[0]}", f"b:{lines[2]}"]


@pytest.mark.parametrize(
    "row,reason",
    [
        ({"id": "m"}, "missing_field"),
        ({"conversations": [{"from": "human"}]}, "missing_field"),
        ({"messages": [{"role": "user"}]}, "missing_field"),
        ({"input_ids": [1, 2]}, "missing_field"),
        ([1, 2, 3], "wrong_type"),
        ({"conversations": "hello"}, "wrong_type"),
        ({"conversations": [{"from": "human", "value": 5}, {"from": "gpt", "value": "x"}]}, "wrong_type"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, "wrong_type"),
        ({"input_ids": [1, "2"], "loss_mask": [0, 1]}, "wrong_type"),
        ({"conversations": [{"from": "robot", "value": "beep"}, {"from": "gpt", "value": "x"}]}, "unknown_role"),
        ({"messages": [{"role": "tool", "content": "{}"}, {"role": "assistant", "content": "x"}]}, "unknown_role"),
        ({"conversations": []}, "empty_conversation"),
        ({"conversations": [{"from": "human", "value": "only me"}]}, "no_assistant"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]}, "no_assistant"),
        ({"input_ids": [1, 2, 3], "loss_mask": [0, 1]}, "length_mismatch"),
        ({"input_ids": [1, 49152], "loss_mask": [0, 1]}, "token_out_of_range"),
        ({"input_ids": [-1, 5], "loss_mask": [0, 1]}, "token_out_of_range"),
        ({"input_ids": [1, 2], "loss_mask": [0, 2]}, "bad_loss_mask"),
        ({"input_ids": [1, 2], "loss_mask": [0, 0]}, "no_assistant"),
        ('{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "bad \\ud83d"}]}', "non_utf8"),
    ],
)
def test_bad_row_is_counted_with_file_line_and_good_rows_survive(tmp_path, run, row, reason):
    f = jsonl(tmp_path / "rows.jsonl", [conv(id="before"), row, conv(id="after")])
    meta = run(f)
    assert reasons(meta) == {reason: 1}
    assert where(meta, reason) == [f"{f}:2"]
    assert PreparedData(tmp_path / "out").ids() == ["before", "after"]
    with pytest.raises(EaglenestError, match=f"{f}:2"):
        run(f, strict=True, out=tmp_path / "strict")


def test_explicit_format_that_does_not_match(tmp_path, run):
    f = jsonl(tmp_path / "a.jsonl", [conv(id="s"), {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}])
    meta = run(f, format="messages")
    assert reasons(meta) == {"missing_field": 1} and meta["n_samples"] == 1


def test_overlength_truncate_and_drop(tmp_path, run):
    long = " ".join(["word"] * 200)
    rows = [conv(id="short"), conv(answer=long, id="long"), conv(text=long, id="long_prompt")]
    f = jsonl(tmp_path / "a.jsonl", rows)
    meta = run(f, max_length=64)
    assert meta["notes"]["truncated"] == 1
    assert reasons(meta) == {"no_assistant_after_truncation": 1}
    assert where(meta, "no_assistant_after_truncation") == [f"{f}:3"]
    d = PreparedData(tmp_path / "out")
    assert d.ids() == ["short", "long"] and len(d[1].input_ids) == 64 and d.meta["max_length"] == 64

    meta = run(f, max_length=64, on_overlength="drop", out=tmp_path / "drop")
    assert meta["notes"]["truncated"] == 0
    assert reasons(meta) == {"overlength": 2} and where(meta, "overlength") == [f"{f}:2", f"{f}:3"]
    assert PreparedData(tmp_path / "drop").ids() == ["short"]


def test_non_utf8_bytes(tmp_path, run):
    bad = json.dumps(conv(id="bad")).encode().replace(b"Hello", b"Hel\xfflo")
    f = jsonl(tmp_path / "a.jsonl", [conv(id="g1"), bad, conv(id="g2")])
    meta = run(f)
    assert reasons(meta) == {"non_utf8": 1} and where(meta, "non_utf8") == [f"{f}:2"]
    assert PreparedData(tmp_path / "out").ids() == ["g1", "g2"]

    arr = b"[\n" + json.dumps(conv(id="a1")).encode() + b",\n" + bad + b",\n" + json.dumps(conv(id="a2")).encode() + b"\n]\n"
    g = tmp_path / "b.json"
    g.write_bytes(arr)
    meta = run(g, out=tmp_path / "arr")
    assert reasons(meta) == {"non_utf8": 1} and where(meta, "non_utf8") == [f"{g}:3"]
    assert PreparedData(tmp_path / "arr").ids() == ["a1", "a2"]


def test_missing_input_file(tmp_path, run, smollm2, capsys):
    from eaglenest.cli import main

    missing = tmp_path / "nope.jsonl"
    with pytest.raises(EaglenestError, match="nope.jsonl"):
        run(missing)
    assert main(["prepare", "--model", str(smollm2), "--data", str(missing), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "input file not found" in err and str(missing) in err and "Traceback" not in err


def test_gz_inputs(tmp_path, run):
    a = tmp_path / "a.jsonl.gz"
    a.write_bytes(gzip.compress((json.dumps(conv(id="j1")) + "\n" + json.dumps(conv(id="j2")) + "\n").encode()))
    b = tmp_path / "b.json.gz"
    b.write_bytes(gzip.compress(json.dumps([conv(), conv(id="k2")], indent=2).encode()))
    meta = run(a, b)
    assert meta["n_samples"] == 4 and meta["failures"]["total"] == 0
    assert PreparedData(tmp_path / "out").ids() == ["j1", "j2", "b:2", "k2"]


def test_corrupt_gz_is_reported_not_fatal(tmp_path, run):
    a = tmp_path / "a.jsonl.gz"
    a.write_bytes(gzip.compress((json.dumps(conv(id="j1")) + "\n").encode() * 200)[:-20])
    good = jsonl(tmp_path / "good.jsonl", [conv(id="ok")])
    meta = run(a, good)
    assert reasons(meta) == {"read_error": 1} and where(meta, "read_error")[0].startswith(f"{a}:")
    assert "ok" in PreparedData(tmp_path / "out").ids()


def test_duplicate_ids_are_renamed_not_failed(tmp_path, run):
    rows = [conv(id="x"), conv(id="x"), conv(id="y"), conv(id="x"), conv(id=7), '{"id": "z\\udc80", "conversations": ' + json.dumps(conv()["conversations"]) + "}"]
    meta = run(jsonl(tmp_path / "a.jsonl", rows))
    assert meta["failures"]["total"] == 0 and meta["notes"]["duplicate_id_renamed"] == 2
    assert PreparedData(tmp_path / "out").ids() == ["x", "x#2", "y", "x#3", "7", "z\\udc80"]


def test_all_bad_is_an_error(tmp_path, run):
    f = jsonl(tmp_path / "a.jsonl", ["{", {"conversations": []}])
    with pytest.raises(EaglenestError, match="no usable samples"):
        run(f)


def test_limit_counts_good_samples(tmp_path, run):
    f = jsonl(tmp_path / "a.jsonl", [conv(id="a"), "{", conv(id="b"), conv(id="c")])
    meta = run(f, limit=2)
    assert meta["n_samples"] == 2 and meta["sources"][0]["n_read"] == 3


def _mixed_file(tmp_path: Path, vocab_ids: list[int]) -> Path:
    return jsonl(
        tmp_path / "mixed.jsonl",
        [
            conv("What is 2+2?", "2+2 equals 4.", id="sg"),
            {"id": "oa", "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Name a"}, {"type": "text", "text": "color."}]},
                {"role": "assistant", "content": "Blue."},
            ]},
            {"input_ids": vocab_ids, "loss_mask": [0, 0, 1, 1]},
            {"conversations": [{"from": "alien", "value": "?"}]},
            conv("again", "Sure.", id="sg"),
        ],
    )


def test_cli_end_to_end_mixed_file(tmp_path, smollm2, tok, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from eaglenest.cli import main

    token_row = [1, 4093, 198, 2]
    f = _mixed_file(tmp_path, token_row)
    out = tmp_path / "data"
    rc = main(["prepare", "--model", str(smollm2), "--data", str(f), "--out", str(out), "--shard-size", "2"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "prepared 4 samples" in captured.out and "unknown_role: 1" in captured.out

    table = pa.concat_tables([pq.read_table(p) for p in sorted(out.glob("data-*.parquet"))])
    assert table.schema.field("id").type == pa.string()
    assert table.schema.field("input_ids").type == pa.list_(pa.int32())
    assert table.schema.field("loss_mask").type == pa.list_(pa.uint8())
    assert table.column("id").to_pylist() == ["sg", "oa", "mixed:3", "sg#2"]

    d = PreparedData(out)
    meta = d.meta
    assert len(d) == 4 and len(meta["shards"]) == 2 and meta["vocab_size"] == len(tok)
    assert meta["target"] == str(smollm2) and meta["failures"]["by_reason"] == {"unknown_role": 1}
    assert meta["sources"][0]["format"] == "messages+sharegpt+tokens"
    assert meta["notes"]["duplicate_id_renamed"] == 1
    assert d[2].input_ids == token_row and d[2].loss_mask == [0, 0, 1, 1]
    oa = d[1]
    text = tok.decode(oa.input_ids)
    assert "Name a\ncolor." in text  # text parts joined with a newline
    masked = [t for t, m in zip(oa.input_ids, oa.loss_mask) if m]
    assert tok.decode(masked) == "Blue.<|im_end|>"
    counts = d.token_counts()
    assert int(counts.sum()) == meta["n_masked_tokens"] == sum(sum(s.loss_mask) for s in d)


def test_cli_sharegpt_builtin_with_limit(tmp_path, tok):
    from eaglenest.cli import main

    out = tmp_path / "sg"
    rc = main(["prepare", "--model", "smollm2", "--data", "sharegpt:", "--limit", "50", "--out", str(out),
               "--max-length", "512", "--shard-size", "20"])
    assert rc == 0
    d = PreparedData(out)
    assert len(d) == 50 and d.meta["shards"] == ["data-00000.parquet", "data-00001.parquet", "data-00002.parquet"]
    src = d.meta["sources"][0]
    assert src["path"].endswith("ShareGPT_V3_unfiltered_cleaned_split.json") and src["format"] == "sharegpt"
    assert src["n_ok"] == 50 and d.meta["notes"]["end_of_turn_tokens"].keys() == {"<|im_end|>"}
    ids = d.ids()
    assert len(set(ids)) == 50 and ids[0] == "QWJhYvA_0"
    for s in d:
        assert 0 < len(s.input_ids) <= 512 and any(s.loss_mask)
    # every masked span ends with the end-of-turn token (or is cut by truncation at the very end)
    s = d[0]
    ends = [i for i in range(len(s.loss_mask)) if s.loss_mask[i] and (i + 1 == len(s.loss_mask) or not s.loss_mask[i + 1])]
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert all(s.input_ids[i] == im_end for i in ends if i + 1 < len(s.loss_mask))


def test_sharegpt_n_reads_only_first_items(tmp_path, run):
    meta = run("sharegpt:5")
    assert meta["sources"][0]["n_read"] == 5
