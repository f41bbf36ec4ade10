"""Live: `eaglenest regenerate --engine vllm` on real SmolLM2 samples, end to end."""

from __future__ import annotations

import json

import pytest

from vllm_helpers import make_tiny_data, requires_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow, requires_vllm]


def test_regenerate_with_vllm(smollm2, tmp_path, capsys):
    from eaglenest.cli import main
    from eaglenest.data import PreparedData
    from eaglenest.data.regenerate import turn_spans

    src = make_tiny_data(tmp_path / "src", str(smollm2), n=3, max_length=256)
    out = tmp_path / "regen"
    argv = ["regenerate", "--model", str(smollm2), "--data", str(src), "--out", str(out), "--engine", "vllm",
            "--temperature", "0", "--max-new-tokens", "48", "--vllm-log", str(tmp_path / "server.log")]
    assert main(argv) == 0, (tmp_path / "server.log").read_text()[-3000:]
    err = capsys.readouterr().err
    with capsys.disabled():
        print("\n".join(line for line in err.splitlines() if "tok/s" in line or "server ready" in line))

    orig = {s.id: s for s in PreparedData(src)}
    new = PreparedData(out)
    assert len(new) == 3 and sorted(new.ids()) == sorted(orig)
    rows = {r["id"]: r for r in map(json.loads, (out / "regenerate.jsonl").read_text().splitlines())}
    EOT = 2  # <|im_end|>
    for s in new:
        o = orig[s.id]
        s0 = turn_spans(o.loss_mask)[0][0]
        assert s.input_ids[:s0] == o.input_ids[:s0] and not any(s.loss_mask[:s0]), "the prompt is kept verbatim"
        spans = turn_spans(s.loss_mask)
        assert spans and spans[0][0] == s0
        r = rows[s.id]
        assert len(spans) == r["turns"] and sum(s.loss_mask) == r["generated_tokens"]
        for k, (a, b) in enumerate(spans):
            stopped = r["finish"][k] == "stop"
            assert (s.input_ids[b - 1] == EOT) == stopped, "a turn the model ended itself ends with <|im_end|>"
            assert b - a <= 48
    meta = new.meta["notes"]["regenerated"]
    assert meta["engine"] == "vllm" and meta["samples"] == 3

    # resumable: a re-run finds everything done and rewrites the same DATA_DIR
    before = {s.id: (s.input_ids, s.loss_mask) for s in new}
    assert main(argv) == 0
    assert "0 samples to do (3 already done)" in capsys.readouterr().err
    assert {s.id: (s.input_ids, s.loss_mask) for s in PreparedData(out)} == before
