"""Feature stores of any layer count (issue 25 item 2): a store's aux states are [T, n*H] with
n = len(store.json layer_ids); five-layer (DFlash) stores captured by the hf engine on the real
SmolLM2 verify, convert, merge and report like three-layer ones, the capture plan sizes n layers,
stores written before (three layers, the same store.json keys) read as they did, and an EAGLE-3
training run refuses a store of another count by name."""

from __future__ import annotations

import json
import shutil

import torch

from conftest import FIVE_LAYERS
from eaglenest.cli import main
from eaglenest.features import FeatureStore, FeatureWriter, StoreMeta
from eaglenest.features.store import bytes_per_token, validate_sample

H = 576


def _refused(argv, capsys) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    return capsys.readouterr().err


def test_validation_reads_the_layer_count_from_the_store():
    def meta(ids):
        return StoreMeta("t", "fp", H, 30, ids, "post", "bf16", "hf")

    def sample(n):
        return {"input_ids": torch.zeros(4, dtype=torch.int32), "loss_mask": torch.ones(4, dtype=torch.uint8),
                "aux_hidden_states": torch.zeros(4, n * H), "last_hidden_state": torch.zeros(4, H)}

    assert meta(FIVE_LAYERS).aux_layers == 5
    assert validate_sample(sample(5), meta(FIVE_LAYERS)) is None
    assert validate_sample(sample(3), meta([2, 15, 27])) is None
    assert validate_sample(sample(3), meta(FIVE_LAYERS)) == f"bad_shape: aux_hidden_states (4, {3 * H}) != (4, {5 * H})"
    assert validate_sample(sample(5), meta([2, 15, 27])).startswith("bad_shape: aux_hidden_states")
    assert validate_sample(sample(1), meta([15])) is None


def test_five_layer_store_verify_stats_convert_merge(smol_store_5, tmp_path, capsys):
    src = FeatureStore(smol_store_5)
    assert src.meta.layer_ids == FIVE_LAYERS and src.verify() == []
    assert main(["features", "verify", str(smol_store_5)]) == 0
    capsys.readouterr()
    assert main(["features", "stats", str(smol_store_5), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["layer_ids"] == FIVE_LAYERS and st["samples"] == 24
    # what is on disk is what the plan sizes: five fp32 layers + the final state per token (+ headers)
    per = bytes_per_token(H, "fp32", aux_layers=5)
    assert per == 5 * H * 4 + H * 4 + 5 and per * st["tokens"] <= st["bytes"] <= per * st["tokens"] * 1.01
    # convert: fp8 keeps one exponent per fp8 block of every layer (5 x H / block), bf16 is exactly the cast
    assert main(["features", "convert", str(smol_store_5), "--store-dtype", "fp8", "--out", str(tmp_path / "f8")]) == 0
    assert main(["features", "convert", str(smol_store_5), "--store-dtype", "bf16", "--out", str(tmp_path / "b16")]) == 0
    f8, b16 = FeatureStore(tmp_path / "f8"), FeatureStore(tmp_path / "b16")
    assert f8.verify() == [] and b16.verify() == [] and f8.ids() == b16.ids() == src.ids()
    for i in (0, 13, 23):
        a = src[i]["aux_hidden_states"]
        assert torch.equal(b16[i]["aux_hidden_states"], a.to(torch.bfloat16))
        raw = f8.load_stored(i)
        assert raw["aux_hidden_states"].shape == a.shape and raw["aux_hidden_states_exp"].shape == (a.shape[0], 5 * H // f8.meta.fp8_block)
        d = f8[i]["aux_hidden_states"].float()
        for j in range(5):  # each layer's chunk decodes to its own layer (a per-layer scale mixed up would not)
            cos = torch.nn.functional.cosine_similarity(d[:, j * H:(j + 1) * H], a[:, j * H:(j + 1) * H], dim=-1)
            assert cos.min() > 0.99, (i, j, cos.min())
    # merge: two halves of the five-layer store give back the whole, byte for byte
    ids = src.ids()
    for name, keep in (("A", range(0, 14)), ("B", range(10, 24))):
        shutil.copytree(smol_store_5, tmp_path / name)
        FeatureStore(tmp_path / name).drop({ids[i] for i in range(24) if i not in keep})
    assert main(["features", "merge", str(tmp_path / "A"), str(tmp_path / "B"), "--out", str(tmp_path / "C")]) == 0
    c = FeatureStore(tmp_path / "C")
    assert c.verify() == [] and sorted((e["id"], e["sha256"]) for e in c.entries) == sorted((e["id"], e["sha256"]) for e in src.entries)
    # a three-layer store of the same target is another setup
    three = tmp_path / "three"
    shutil.copytree(tmp_path / "A", three)
    st3 = json.loads((three / "store.json").read_text())
    (three / "store.json").write_text(json.dumps({**st3, "layer_ids": [2, 15, 28]}))
    err = _refused(["features", "merge", str(tmp_path / "B"), str(three), "--out", str(tmp_path / "X")], capsys)
    assert "layer_ids" in err and str(FIVE_LAYERS) in err
    assert FeatureStore(three).verify() != []  # and its samples are [T, 5H]: every one fails the shape check


def test_capture_plan_sizes_the_layers_it_captures(smollm2, tmp_path, capsys):
    def plan(layers):
        capsys.readouterr()
        assert main(["capture", "--model", str(smollm2), "--out", str(tmp_path / "p"), "--dry-run", "--tokens", "1000000",
                     "--layers", layers, "--store-dtype", "bf16"]) == 0
        return capsys.readouterr().err

    three, five = plan("auto"), plan(",".join(map(str, FIVE_LAYERS)))
    # bf16: n x 576 x 2 + 576 x 2 + 5 bytes per token
    assert "aux layers [2, 15, 27]" in three and f"{3 * H * 2 + H * 2 + 5:,}" in three
    assert f"aux layers {FIVE_LAYERS}" in five and f"{5 * H * 2 + H * 2 + 5:,}" in five and "6,917" in five
    assert not (tmp_path / "p").exists()


def test_a_store_written_before_reads_as_it_did(tmp_path):
    """Three-layer stores (all that earlier versions wrote) carry the same store.json keys and read
    as they did: nothing in the format depends on a new field."""
    before = {"target": "t", "target_fingerprint": "fp", "hidden_size": 8, "num_layers": 30, "layer_ids": [2, 15, 27],
              "final_norm": "post", "dtype": "bf16", "engine": "hf", "convention": "capture-before", "vocab_size": 100,
              "format_version": 1}
    out = tmp_path / "old"
    w = FeatureWriter(out, StoreMeta.from_dict(before))
    g = torch.Generator().manual_seed(0)
    t = {"input_ids": torch.arange(6, dtype=torch.int32), "loss_mask": torch.ones(6, dtype=torch.uint8),
         "aux_hidden_states": torch.randn(6, 24, generator=g).bfloat16(), "last_hidden_state": torch.randn(6, 8, generator=g).bfloat16()}
    w.write_batch([("s0", t)])
    assert json.loads((out / "store.json").read_text()) == before  # no new key written
    fs = FeatureStore(out)
    assert fs.meta.aux_layers == 3 and fs.verify() == [] and torch.equal(fs[0]["aux_hidden_states"], t["aux_hidden_states"])


def test_eagle3_training_refuses_a_five_layer_store(smollm2, smol_store_5, tmp_path, capsys):
    err = _refused(["train", "--model", str(smollm2), "--features", str(smol_store_5), "--out", str(tmp_path / "run"),
                    "--device", "cpu"], capsys)
    assert "EAGLE-3 draft reads exactly 3 aux layers" in err and str(FIVE_LAYERS) in err and str(smol_store_5) in err
