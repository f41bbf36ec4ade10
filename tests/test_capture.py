"""HF capture on the real SmolLM2: the right layers, the right norm, token-exact, resumable
after SIGKILL, and a store that detects damage."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eaglenest import EaglenestError
from eaglenest.capture.layers import default_layer_ids, from_output_of, parse_layer_ids, to_output_of
from eaglenest.cli import main
from eaglenest.data import PreparedData
from eaglenest.features import FeatureStore


def test_layer_conventions():
    assert default_layer_ids(32) == [2, 16, 29]  # Llama-3.1-8B: HF hidden_states[2], [16], [29]
    assert to_output_of([2, 16, 29]) == [1, 15, 28]  # SpecForge / ModelOpt form of the same tensors
    assert from_output_of(to_output_of([2, 15, 27])) == [2, 15, 27]
    assert parse_layer_ids("auto", 30) == [2, 15, 27]
    assert parse_layer_ids("3,10,20", 30) == [3, 10, 20]
    for bad in ("1,2", "0,5,9", "5,5,9", "2,15,30", "a,b,c"):
        with pytest.raises(EaglenestError):
            parse_layer_ids(bad, 30)


@pytest.fixture(scope="module")
def smol_store(smollm2, smol_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("feat") / "f"
    assert main(["capture", "--model", str(smollm2), "--data", str(smol_data), "--out", str(out), "--batch-tokens", "1024", "--device", "cpu"]) == 0
    return out


def test_capture_equals_plain_output_hidden_states(smollm2, smol_data, smol_store):
    from transformers import AutoModelForCausalLM

    fs = FeatureStore(smol_store)
    data = PreparedData(smol_data)
    assert len(fs) == len(data) == 24
    assert fs.meta.layer_ids == [2, 15, 27] and fs.meta.final_norm == "post" and fs.meta.convention == "capture-before"
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.bfloat16).eval()
    by_id = {s.id: s for s in data}
    for i in (0, 7, 23):
        x = fs[i]
        s = by_id[x["id"]]
        assert x["input_ids"].tolist() == s.input_ids and x["loss_mask"].tolist() == s.loss_mask
        with torch.no_grad():
            hs = model(torch.tensor([s.input_ids]), output_hidden_states=True).hidden_states
        T = len(s.input_ids)
        for j, k in enumerate([2, 15, 27]):
            got = x["aux_hidden_states"][:, j * 576 : (j + 1) * 576].float()
            ref = hs[k][0].float()
            cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
            assert cos.min() > 0.995, (k, cos.min())
            # and it is NOT the neighbouring layer (an off-by-one would pass a loose check)
            wrong = torch.nn.functional.cosine_similarity(got, hs[k + 1][0].float(), dim=-1)
            assert cos.mean() > wrong.mean() + 0.005
        last = torch.nn.functional.cosine_similarity(x["last_hidden_state"].float(), hs[-1][0].float(), dim=-1)
        assert last.min() > 0.995 and x["last_hidden_state"].shape == (T, 576)


def _store_tensors(path):
    fs = FeatureStore(path)
    return {fs[i]["id"]: fs.load_tensors(i) for i in range(len(fs))}


def test_sigkill_then_resume_equals_uninterrupted(smollm2, smol_data, smol_store, tmp_path):
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "eaglenest", "capture", "--model", str(smollm2), "--data", str(smol_data),
           "--out", str(out), "--batch-tokens", "1024", "--device", "cpu"]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and p.poll() is None:
        m = out / "manifest.jsonl"
        if m.exists() and len(m.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    killed_mid_run = p.poll() is None
    p.send_signal(signal.SIGKILL)
    p.wait()
    n_before = len((out / "manifest.jsonl").read_text().splitlines())
    assert killed_mid_run and 3 <= n_before < 24, n_before
    assert main(cmd[3:]) == 0  # the same command resumes
    ref = _store_tensors(smol_store)
    got = _store_tensors(out)
    fs = FeatureStore(out)
    assert len(fs.ids()) == len(set(fs.ids())) == 24  # no duplicates, nothing missing
    assert set(got) == set(ref)
    for sid in ref:  # batch composition is planned over the whole data set: bit-identical
        for name in ref[sid]:
            assert torch.equal(got[sid][name], ref[sid][name]), (sid, name)
    assert fs.verify() == []


def test_dry_run_writes_nothing(smollm2, smol_data, tmp_path, capsys):
    out = tmp_path / "dry"
    assert main(["capture", "--model", str(smollm2), "--data", str(smol_data), "--out", str(out), "--dry-run"]) == 0
    err = capsys.readouterr().err
    assert "24 samples" in err and "on disk" in err
    assert not (out / "manifest.jsonl").exists()


def test_verify_detects_damage_and_capture_repairs_it(smollm2, smol_data, smol_store, tmp_path):
    import shutil

    out = tmp_path / "damaged"
    shutil.copytree(smol_store, out)
    fs = FeatureStore(out)
    victim = fs.entries[5]
    shard = out / "shards" / victim["shard"]
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF  # flip a bit in the last sample's data
    shard.write_bytes(bytes(data))
    problems = FeatureStore(out).verify()
    assert problems and all(p["shard"] == victim["shard"] for p in problems)
    assert main(["features", "verify", str(out)]) == 1
    assert main(["features", "verify", str(out), "--repair"]) == 0
    assert len(FeatureStore(out)) == 24 - len(problems)
    assert main(["capture", "--model", str(smollm2), "--data", str(smol_data), "--out", str(out), "--batch-tokens", "1024", "--device", "cpu"]) == 0
    fs2 = FeatureStore(out)
    assert len(fs2) == 24 and fs2.verify() == []
    # a truncated shard is detected too
    other = next(e for e in fs2.entries if e["shard"] != victim["shard"])
    p = out / "shards" / other["shard"]
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    assert any(x["shard"] == other["shard"] for x in FeatureStore(out).verify())


def test_store_from_another_setup_is_refused(tiny_llama_dir, smol_data, smol_store):
    with pytest.raises(EaglenestError, match="different setup"):
        from eaglenest.capture.run import run_capture
        from eaglenest.engines.hf import HFEngine

        with HFEngine(str(tiny_llama_dir), device="cpu") as e:
            run_capture(e, PreparedData(smol_data), Path(smol_store))
