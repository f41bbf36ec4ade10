"""Compact (fp8) stores, convert / stats / merge, and the capture plan for a Kimi-K2.5-shaped
target: on real SmolLM2 features where values matter, a config-only target where only sizes do."""

import json
import re
import shutil

import pytest
import torch

from eaglenest.cli import main
from eaglenest.features import FeatureStore
from eaglenest.features.store import bytes_per_token, fp8_decode, fp8_encode


@pytest.fixture(scope="module")
def smol_store(smollm2, smol_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("feat") / "bf16"
    assert main(["capture", "--model", str(smollm2), "--data", str(smol_data), "--out", str(out), "--batch-tokens", "1024", "--device", "cpu"]) == 0
    return out


@pytest.fixture(scope="module")
def fp8_store(smol_store, tmp_path_factory):
    out = tmp_path_factory.mktemp("feat") / "fp8"
    assert main(["features", "convert", str(smol_store), "--store-dtype", "fp8", "--out", str(out)]) == 0
    return out


def _refused(argv, capsys) -> str:
    """Run the CLI, expect the one-line error (exit 2), return it."""
    capsys.readouterr()
    assert main(argv) == 2
    return capsys.readouterr().err


def _flushed(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Values the codec turned to zero."""
    return (x != 0) & (y == 0)


@pytest.mark.parametrize("block", [256, 128], ids=["one-scale-per-token-and-layer", "block128"])
def test_fp8_codec_is_exact_in_bf16_and_within_e4m3_precision(block):
    g = torch.Generator().manual_seed(0)
    H = 256
    # 3 layers per token, magnitudes from 1e-4 to 1e4 across tokens, one layer of a token all zero,
    # a massive-activation channel, and values that land exactly on the top of the e4m3 range
    x = torch.randn(64, 3 * H, generator=g) * torch.logspace(-4, 4, 64)[:, None]
    x[5, H : 2 * H] = 0
    x[7, 3] = 28672.0  # 1.75 * 2**14, exact in e4m3: 10^7 times its row's other values
    x[9, :] = 448.0
    x = x.bfloat16()
    codes, exp = fp8_encode(x, block)
    assert codes.dtype == torch.float8_e4m3fn and exp.dtype == torch.int8 and exp.shape == (64, 3 * H // block)
    b = codes.view(torch.uint8)
    assert not ((b & 0x7F) == 0x7F).any()  # no NaN code
    assert not (((b & 0x78) == 0) & ((b & 0x07) != 0)).any()  # no subnormal code (the decoder relies on it)
    y = fp8_decode(codes, exp)
    ref = (codes.float().view(64, -1, block) * torch.exp2(exp.float())[:, :, None]).view(64, -1)
    assert y.dtype == torch.bfloat16 and torch.equal(y.float(), ref)  # exact: a power-of-two scale
    xf, yf = x.float(), y.float()
    amax = xf.view(64, -1, block).abs().amax(-1, keepdim=True).expand(64, -1, block).reshape(64, -1)
    flushed = _flushed(xf, yf)
    # a value is flushed when its code would be an e4m3 subnormal (below 2**-6 at a scale that puts its
    # block's absmax in (224, 448]): surely below absmax * 2**-14.81 * 15/16 (rounding), never from
    # absmax * 2**-13.8 up; every other value keeps 3 mantissa bits
    assert (xf.abs()[flushed] < amax[flushed] * 2**-13.8).all()
    assert flushed[(xf != 0) & (xf.abs() < amax * 2**-14.81 * 15 / 16)].all()
    assert ((yf - xf).abs() <= xf.abs() * 2**-4)[~flushed].all()  # half an ulp
    assert torch.equal(y[5, H : 2 * H], torch.zeros(H, dtype=torch.bfloat16)) and torch.equal(y[9], x[9])
    # the flushed share, explicitly: the outlier's scale takes every other value of its block with it
    # (all of token 7's first layer with one scale per layer, its first 128 values with blocks) ...
    assert flushed[7, :block].sum() == block - 1 and not flushed[7, block:].any() and yf[7, 3] == 28672.0
    # ... while of Gaussian blocks only the rare value 10^4 times below the block's absmax is lost
    rest = flushed.clone()
    rest[7, :block] = False
    assert rest.float().mean() < 2e-4, rest.float().mean()


def test_fp8_block_scales_keep_the_small_channels_of_massive_activations():
    """Real targets' massive activations: a few fixed channels 10^3-10^4 times the rest (Qwen2.5's
    reach ~10^4, git show afe579c:bench/results/store_outliers.json).  One scale per (token, layer) flushes or
    coarsens every small channel of the token; one per 128 values costs only the outliers' blocks."""
    g = torch.Generator().manual_seed(1)
    H, T = 512, 256
    x = torch.randn(T, H, generator=g)
    x += 0.05 * x.sign()  # no value within 2**-14 of its block's absmax by chance: what is flushed is the scheme's doing
    x[:, 3] = 5e3 * (1 + torch.rand(T, generator=g))  # two massive channels, in blocks 0 and 2 of 4
    x[:, 300] = -2e3
    x = x.bfloat16()
    xf = x.float()
    small = torch.ones(H, dtype=torch.bool)
    small[[3, 300]] = False
    per_layer = fp8_decode(*fp8_encode(x, H)).float()
    blocks = fp8_decode(*fp8_encode(x, 128)).float()
    # one scale per (token, layer): the small values below ~absmax * 2**-14 (|x| < 0.2-0.7 here, a
    # quarter of them) are flushed outright, the rest keep 1-3 bits
    f = _flushed(xf, per_layer)[:, small].float().mean()
    assert f > 0.15, f
    err_layer = (per_layer - xf)[:, small].norm() / xf[:, small].norm()
    assert err_layer > 0.1, err_layer
    # one per 128 values: blocks 1 and 3 (no outlier) keep e4m3's full precision, nothing flushed there;
    # blocks 0 and 2 lose what one scale per layer loses
    clean = torch.zeros(H, dtype=torch.bool)
    clean[128:256] = clean[384:512] = True
    assert not _flushed(xf, blocks)[:, clean].any()
    assert ((blocks - xf).abs() <= xf.abs() * 2**-4)[:, clean].all()
    err_blocks = (blocks - xf)[:, small].norm() / xf[:, small].norm()
    assert err_blocks < err_layer * 0.75, (err_blocks, err_layer)
    assert torch.equal(blocks[:, [3, 300]], per_layer[:, [3, 300]])  # the outliers themselves: the same codes


def test_fp8_store_reads_decoded_on_every_read_path(smol_store, fp8_store):
    from eaglenest.train.data import collate

    src, fs = FeatureStore(smol_store), FeatureStore(fp8_store)
    assert fs.meta.dtype == "fp8" and len(fs) == len(src) == 24 and fs.verify() == []
    assert fs.ids() == src.ids() and fs.lengths() == src.lengths()
    st = json.loads((fp8_store / "store.json").read_text())
    assert {k: v for k, v in st.items() if k not in ("dtype", "fp8_block")} == {
        k: v for k, v in json.loads((smol_store / "store.json").read_text()).items() if k != "dtype"}
    # on disk: half of bf16's bytes (F8_E4M3 tensors in the shards)
    ratio = fs.bytes_on_disk() / src.bytes_on_disk()
    assert ratio <= 0.55, ratio
    assert bytes_per_token(576, "fp8") / bytes_per_token(576, "bf16") <= 0.55
    assert fs.meta.fp8_block == st["fp8_block"] == 96  # the largest divisor of 576 <= 128: one int8 exponent per 96 codes
    assert "fp8_block" not in json.loads((smol_store / "store.json").read_text())  # bf16 stores: store.json as before
    header = (fp8_store / "shards" / fs.entries[0]["shard"]).read_bytes()[:4096]
    assert b'"F8_E4M3"' in header and b'"I8"' in header
    for i in (0, 11, 23):
        a, b = src[i], fs[i]
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        for name in ("aux_hidden_states", "last_hidden_state"):
            assert b[name].dtype == torch.bfloat16 and b[name].shape == a[name].shape
            cos = torch.nn.functional.cosine_similarity(a[name].float(), b[name].float(), dim=-1)
            assert cos.min() > 0.998, (name, cos.min())
        # the shard handle (what collate and the trainer's mask/vocab reads use) decodes too
        e = fs.entries[i]
        assert torch.equal(fs._open(e["shard"]).get_tensor(f"{e['key']}.aux_hidden_states"), b["aux_hidden_states"])
    batch = collate(fs, [0, 1, 2])
    assert batch.aux.dtype == torch.bfloat16 and batch.aux.shape[-1] == 3 * 576 and batch.last.shape[-1] == 576


def test_fp8_capture_equals_convert_and_damage_is_detected(smollm2, smol_data, fp8_store, tmp_path):
    out = tmp_path / "cap8"
    assert main(["capture", "--model", str(smollm2), "--data", str(smol_data), "--out", str(out), "--batch-tokens", "1024",
                 "--device", "cpu", "--store-dtype", "fp8"]) == 0
    a, b = FeatureStore(out), FeatureStore(fp8_store)
    assert a.meta.dtype == "fp8" and sorted(a.ids()) == sorted(b.ids())
    by_id = {sid: i for i, sid in enumerate(b.ids())}
    for i, sid in enumerate(a.ids()):  # the same bf16 states encode to the same bytes
        ra, rb = a.load_stored(i), b.load_stored(by_id[sid])
        assert set(ra) == set(rb) == {"input_ids", "loss_mask", "aux_hidden_states", "aux_hidden_states_exp",
                                      "last_hidden_state", "last_hidden_state_exp"}
        for n in ra:
            assert torch.equal(ra[n].view(torch.uint8), rb[n].view(torch.uint8)), (sid, n)
    assert a.entries[0]["sha256"] == b.entries[by_id[a.ids()[0]]]["sha256"]
    # a flipped bit in an fp8 shard is found by verify
    shutil.copytree(out, tmp_path / "dmg")
    victim = a.entries[3]
    p = tmp_path / "dmg" / "shards" / victim["shard"]
    data = bytearray(p.read_bytes())
    data[-50] ^= 0x01
    p.write_bytes(bytes(data))
    problems = FeatureStore(tmp_path / "dmg").verify()
    assert problems and {x["shard"] for x in problems} == {victim["shard"]}
    assert main(["features", "verify", str(tmp_path / "dmg")]) == 1


def test_convert_resumes_after_an_interruption(smol_store, fp8_store, tmp_path, monkeypatch, capsys):
    import errno

    from eaglenest.features.store import FeatureWriter

    real, calls = FeatureWriter.write_batch, {"n": 0}

    def dies(self, samples, encoded=False):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(errno.EIO, "killed")
        return real(self, samples, encoded)

    monkeypatch.setattr(FeatureWriter, "write_batch", dies)
    out = tmp_path / "conv"
    assert "re-run the same command to resume" in _refused(["features", "convert", str(smol_store), "--store-dtype", "fp8", "--out", str(out)], capsys)
    part = len(FeatureStore(out))
    assert 0 < part < 24
    monkeypatch.setattr(FeatureWriter, "write_batch", real)
    assert main(["features", "convert", str(smol_store), "--store-dtype", "fp8", "--out", str(out)]) == 0
    a, b = FeatureStore(out), FeatureStore(fp8_store)
    assert a.ids() == b.ids() and [e["sha256"] for e in a.entries] == [e["sha256"] for e in b.entries] and a.verify() == []
    assert "already holds fp8 (e4m3, one scale per 96 values)" in _refused(
        ["features", "convert", str(fp8_store), "--store-dtype", "fp8", "--out", str(tmp_path / "again")], capsys)
    # back to bf16: exactly the decoded values
    assert main(["features", "convert", str(fp8_store), "--store-dtype", "bf16", "--out", str(tmp_path / "back")]) == 0
    back = FeatureStore(tmp_path / "back")
    assert torch.equal(back[4]["aux_hidden_states"], b[4]["aux_hidden_states"])


def test_stats(smol_store, fp8_store, capsys, tmp_path):
    shutil.copytree(smol_store, tmp_path / "s")
    (tmp_path / "s" / "failures.jsonl").write_text(
        json.dumps({"id": "gone", "reason": "timeout"}) + "\n" + json.dumps({"id": FeatureStore(smol_store).ids()[0], "reason": "timeout"}) + "\n")
    assert main(["features", "stats", str(tmp_path / "s"), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    fs = FeatureStore(smol_store)
    assert st["samples"] == 24 and st["tokens"] == fs.n_tokens == sum(fs.lengths()) and st["bytes"] == fs.bytes_on_disk()
    assert st["dtype"] == "bf16" and st["layer_ids"] == [2, 15, 27] and st["num_layers"] == 30 and st["hidden_size"] == 576
    assert st["target_fingerprint"] == fs.meta.target_fingerprint
    assert st["failures"] == 1 and st["failures_by_reason"] == {"timeout": 1}  # the stored one is not open any more
    assert main(["features", "stats", str(fp8_store)]) == 0
    out = capsys.readouterr().out
    assert "fp8" in out and "24 in" in out and f"{fs.n_tokens:,}" in out


def _split(store, tmp_path, keep_a, keep_b):
    ids = FeatureStore(store).ids()
    a, b = tmp_path / "A", tmp_path / "B"
    tmp_path.mkdir(exist_ok=True)
    for d, keep in ((a, keep_a), (b, keep_b)):
        shutil.copytree(store, d)
        FeatureStore(d).drop({ids[i] for i in range(len(ids)) if i not in keep})
    return a, b


def test_merge_stores_of_several_machines(smol_store, fp8_store, tiny_llama_dir, smol_data, tmp_path, capsys):
    a, b = _split(smol_store, tmp_path, set(range(14)), set(range(12, 24)))  # ids 12, 13 on both
    (b / "failures.jsonl").write_text(json.dumps({"id": "lost-on-B", "reason": "http_5xx"}) + "\n")
    assert main(["features", "merge", str(a), str(b), "--out", str(tmp_path / "C")]) == 0
    assert "2 identical duplicates dropped" in capsys.readouterr().err
    c, src = FeatureStore(tmp_path / "C"), FeatureStore(smol_store)
    assert sorted(c.ids()) == sorted(src.ids()) and c.verify() == []
    ref = {sid: src.entries[i]["sha256"] for i, sid in enumerate(src.ids())}
    assert all(e["sha256"] == ref[e["id"]] for e in c.entries)  # the bytes as captured
    assert json.loads((tmp_path / "C" / "store.json").read_text()) == json.loads((smol_store / "store.json").read_text())
    assert "lost-on-B" in (tmp_path / "C" / "failures.jsonl").read_text()
    # a re-run has nothing left to do
    assert main(["features", "merge", str(a), str(b), "--out", str(tmp_path / "C")]) == 0
    assert len(FeatureStore(tmp_path / "C")) == 24
    # fp8 stores merge the same way (codes and exponents copied as stored)
    a8, b8 = _split(fp8_store, tmp_path / "fp8", set(range(10)), set(range(10, 24)))
    assert main(["features", "merge", str(a8), str(b8), "--out", str(tmp_path / "C8")]) == 0
    c8, src8 = FeatureStore(tmp_path / "C8"), FeatureStore(fp8_store)
    assert c8.meta.dtype == "fp8" and c8.verify() == []
    assert sorted((e["id"], e["sha256"]) for e in c8.entries) == sorted((e["id"], e["sha256"]) for e in src8.entries)
    # refused by name: another dtype, another target, other layers
    err = _refused(["features", "merge", str(a), str(fp8_store), "--out", str(tmp_path / "X")], capsys)
    assert re.search(r"dtype: \S+ has 'bf16', \S+ has 'fp8'", err), err
    other = tmp_path / "tiny"
    assert main(["capture", "--model", str(tiny_llama_dir), "--data", str(smol_data), "--out", str(other), "--limit", "3", "--device", "cpu"]) == 0
    err = _refused(["features", "merge", str(a), str(other), "--out", str(tmp_path / "X")], capsys)
    assert re.search(r"target_fingerprint: .*hidden_size: \S+ has 576, \S+ has 64", err), err
    layers = tmp_path / "tiny_layers"
    assert main(["capture", "--model", str(tiny_llama_dir), "--data", str(smol_data), "--out", str(layers), "--limit", "3",
                 "--device", "cpu", "--layers", "3,4,5"]) == 0
    err = _refused(["features", "merge", str(other), str(layers), "--out", str(tmp_path / "X")], capsys)
    assert re.search(r"layer_ids: \S+ has \[2, 4, 5\], \S+ has \[3, 4, 5\]", err) and "target_fingerprint" not in err, err
    assert not (tmp_path / "X").exists()


def test_merge_skips_damaged_source_samples(smol_store, tmp_path):
    a, b = _split(smol_store, tmp_path, set(range(12)), set(range(12, 24)))
    fb = FeatureStore(b)
    p = b / "shards" / fb.entries[0]["shard"]
    data = bytearray(p.read_bytes())
    data[-30] ^= 0x10
    p.write_bytes(bytes(data))
    damaged = {x["id"] for x in fb.verify()}
    assert damaged
    assert main(["features", "merge", str(a), str(b), "--out", str(tmp_path / "C")]) == 1  # reported
    c = FeatureStore(tmp_path / "C")
    assert len(c) == 24 - len(damaged) and not damaged & set(c.ids()) and c.verify() == []


def _config_only(tmp_path, hidden, layers):
    d = tmp_path / f"cfg{hidden}"
    d.mkdir()
    # Kimi-K2.5's layout: a multimodal config whose text_config is the DeepSeek-V3-style language model
    (d / "config.json").write_text(json.dumps({"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
                                               "text_config": {"model_type": "kimi_k2", "hidden_size": hidden,
                                                               "num_hidden_layers": layers, "vocab_size": 163840}}))
    return d


def test_dry_run_plans_a_kimi_shaped_capture_from_config_alone(tmp_path, capsys):
    from eaglenest.features.store import free_bytes

    kimi = _config_only(tmp_path, 7168, 61)
    rc = main(["capture", "--model", str(kimi), "--out", str(tmp_path / "f"), "--dry-run", "--tokens", "17300000"])
    err = capsys.readouterr().err
    assert "17,300,000 tokens" in err and "61 layers, hidden 7168" in err
    assert "bf16" in err and "57,349" in err and "924.0 GiB" in err  # 4 x 7168 x 2 + 5 bytes per token: the seed's 924 GB
    # fp8: 4 x 7168 codes + one exponent per 128 of them + 5 bytes
    assert "fp8" in err and "28,901" in err and "465.6 GiB" in err and "<- this run" in err.split("\n  fp8")[1].splitlines()[0]
    assert "store dtype fp8 (e4m3, one scale per 128 values) (auto: hidden size 7168 >= 4096" in err
    fits = free_bytes(tmp_path) >= 17_300_000 * 28_901 * 1.01
    assert rc == (0 if fits else 1) and ("does NOT fit" in err) == (not fits)
    assert "free at" in err and not (tmp_path / "f").exists()


def test_capture_refuses_without_room_before_loading_weights(tmp_path, smol_data, capsys):
    huge = _config_only(tmp_path, 2**30, 61)  # no weights in the directory: a load would fail differently
    err = _refused(["capture", "--model", str(huge), "--data", str(smol_data), "--out", str(tmp_path / "f"), "--store-dtype", "bf16"], capsys)
    assert re.search(r"not enough disk at \S+: [\d,]+ tokens in bf16 need ~[\d.]+ TiB", err), err
    assert not (tmp_path / "f").exists()


# --- issue 22.3: data is never dropped silently --------------------------------------------------
def _store_of(src, dst, keep, edit=None):
    """A store at `dst` holding samples `keep` of `src` as stored (one shard each), `edit(i, raw)`
    applied: what another machine, or an eaglenest without today's checks, could have written."""
    from eaglenest.features.store import FeatureWriter

    fs = FeatureStore(src)
    w = FeatureWriter(dst, fs.meta)
    for i in keep:
        raw = fs.load_stored(i)
        w.write_batch([(fs.entries[i]["id"], edit(i, raw) if edit else raw)], encoded=True)
    return dst


def _rows(path):
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_merge_refuses_differing_samples_under_one_id_unless_told(smol_store, tmp_path, capsys):
    """Ids default to `file stem:line`: two machines that prepared different slices of files with
    the same name store different samples under one id.  Before, merge kept the first and exited 0."""
    fs = FeatureStore(smol_store)
    ids = fs.ids()
    a = _store_of(smol_store, tmp_path / "A", range(14))
    b = _store_of(smol_store, tmp_path / "B", range(12, 24), lambda i, raw: fs.load_stored(20) if i == 13 else raw)
    ea, eb = FeatureStore(a).entries[13], FeatureStore(b).entries[1]  # ids[13] in each: different bytes
    assert ea["id"] == eb["id"] == ids[13] and ea["sha256"] != eb["sha256"]
    argv = ["features", "merge", str(a), str(b)]

    err = _refused(argv + ["--out", str(tmp_path / "C")], capsys)
    assert f"{a}/manifest.jsonl:14 (shard {ea['shard']})" in err and f"{b}/manifest.jsonl:2 (shard {eb['shard']})" in err, err
    assert ids[13] in err and "--on-collision" in err
    assert not (tmp_path / "C").exists()  # refused before anything is written

    assert main(argv + ["--out", str(tmp_path / "C"), "--on-collision", "skip"]) == 0
    out = capsys.readouterr().err
    c = FeatureStore(tmp_path / "C")
    assert sorted(c.ids()) == sorted(ids) and c.verify() == []
    assert c.entries[c.ids().index(ids[13])]["sha256"] == ea["sha256"]  # the first store's
    assert "1 identical duplicate dropped" in out and "1 differing sample under an id already kept: skipped" in out, out
    rec = _rows(tmp_path / "C" / "merges.jsonl")[-1]
    assert rec["identical_duplicates"] == 1 and rec["on_collision"] == "skip"
    assert [(x["id"], x["action"]) for x in rec["collisions"]] == [(ids[13], "skipped")]
    assert rec["collisions"][0]["kept"].startswith(f"{a}/manifest.jsonl:14") and rec["collisions"][0]["other"].startswith(f"{b}/manifest.jsonl:2")

    assert main(argv + ["--out", str(tmp_path / "D"), "--on-collision", "rename"]) == 0
    d = FeatureStore(tmp_path / "D")
    sha = {e["id"]: e["sha256"] for e in d.entries}
    assert len(d) == 25 and sha[ids[13]] == ea["sha256"] and sha[f"{ids[13]}~2"] == eb["sha256"] and d.verify() == []
    rec = _rows(tmp_path / "D" / "merges.jsonl")[-1]
    assert [(x["id"], x["action"]) for x in rec["collisions"]] == [(ids[13], f"renamed to {ids[13]}~2")]
    # re-running the same merge resumes: nothing new, nothing renamed twice
    assert main(argv + ["--out", str(tmp_path / "D"), "--on-collision", "rename"]) == 0
    assert len(FeatureStore(tmp_path / "D")) == 25
    # an output that already holds other bytes under an id is a collision too
    err = _refused(["features", "merge", str(b), str(a), "--out", str(tmp_path / "C")], capsys)
    assert f"{tmp_path / 'C'}/manifest.jsonl:" in err and f"{b}/manifest.jsonl:2" in err, err


def test_convert_validates_every_sample_as_capture_does(smol_store, tmp_path, capsys):
    """Before, convert re-encoded whatever it read: an Inf became a finite 448 * 2**119 in fp8, a
    NaN was carried, a bf16 value beyond fp16's range became Inf.  Now each sample passes capture's
    check (features/store.py validate_sample) before and after re-encoding; failures are counted,
    recorded in OUT/failures.jsonl (a capture into OUT retries them) and make the exit status 1."""
    fs = FeatureStore(smol_store)
    ids = fs.ids()

    def poison(i, raw):
        if i in (3, 8, 10):
            name = "aux_hidden_states" if i != 8 else "last_hidden_state"
            x = raw[name].clone()
            x[5, 7] = {3: float("inf"), 8: float("nan"), 10: 1e6}[i]  # 1e6: finite in bf16, beyond fp16's 65504
            raw = {**raw, name: x}
        return raw

    src = _store_of(smol_store, tmp_path / "src", range(24), poison)
    out = tmp_path / "fp8"
    capsys.readouterr()
    assert main(["features", "convert", str(src), "--store-dtype", "fp8", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    c = FeatureStore(out)
    assert sorted(c.ids()) == sorted(set(ids) - {ids[3], ids[8]}) and c.verify() == []
    fails = {f["id"]: f for f in _rows(out / "failures.jsonl")}
    assert set(fails) == {ids[3], ids[8]} and {f["reason"] for f in fails.values()} == {"non_finite"}
    assert "aux_hidden_states has NaN/Inf" in fails[ids[3]]["message"] and "last_hidden_state" in fails[ids[8]]["message"]
    assert "2 samples failed capture's check (non_finite: 2)" in err, err
    assert main(["features", "stats", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["failures"] == 2
    # the encoded values are checked too: 1e6 has no fp16
    out16 = tmp_path / "fp16"
    assert main(["features", "convert", str(src), "--store-dtype", "fp16", "--out", str(out16)]) == 1
    fails16 = {f["id"]: f for f in _rows(out16 / "failures.jsonl")}
    assert set(fails16) == {ids[3], ids[8], ids[10]} and "fp16" in fails16[ids[10]]["message"]
    assert len(FeatureStore(out16)) == 21


def test_fp8_stores_of_one_scale_per_layer_still_read_and_convert_to_block_scales(smol_store, fp8_store, tmp_path, capsys):
    """An fp8 store written before `fp8_block` existed (one scale per token and layer, no field in
    store.json) reads, verifies and resumes as before, and converts to the block scheme without loss."""
    from eaglenest.features.store import FeatureWriter, StoreMeta

    old = tmp_path / "old"
    assert main(["features", "convert", str(smol_store), "--store-dtype", "fp8", "--fp8-block", "0", "--out", str(old)]) == 0
    st = json.loads((old / "store.json").read_text())
    assert "fp8_block" not in st  # exactly what the code before the field wrote (fingerprints of runs unchanged)
    fs = FeatureStore(old)
    assert fs.meta.fp8_block == 576 and fs.meta.scheme == "fp8 (e4m3, one scale per token and layer)" and fs.verify() == []
    capsys.readouterr()
    assert main(["features", "info", str(old)]) == 0
    assert json.loads(capsys.readouterr().out)["scheme"] == "fp8 (e4m3, one scale per token and layer)"
    raw = fs.load_stored(0)
    T = raw["input_ids"].shape[0]
    assert raw["aux_hidden_states_exp"].shape == (T, 3) and raw["last_hidden_state_exp"].shape == (T, 1)  # the old layout
    src = FeatureStore(smol_store)
    cos = torch.nn.functional.cosine_similarity(fs[5]["aux_hidden_states"].float(), src[5]["aux_hidden_states"].float(), dim=-1)
    assert cos.min() > 0.99
    # resuming into it: the same scheme appends, another is refused by name
    same = StoreMeta.from_dict({**fs.meta.to_dict()})
    FeatureWriter(old, same)
    with pytest.raises(Exception, match=r"fp8_block: store has 576, this run 96"):
        FeatureWriter(old, fs.meta.with_scheme("fp8"))
    assert json.loads((old / "store.json").read_text()) == st  # untouched
    # to blocks: lossless (a finer power-of-two scale only shifts each code's exponent)
    new = tmp_path / "new"
    assert main(["features", "convert", str(old), "--store-dtype", "fp8", "--out", str(new)]) == 0
    nb = FeatureStore(new)
    assert nb.meta.fp8_block == 96 and nb.verify() == [] and nb.ids() == fs.ids()
    for i in (0, 7, 23):
        for name in ("aux_hidden_states", "last_hidden_state"):
            assert torch.equal(nb[i][name], fs[i][name]), (i, name)
    assert "already holds fp8 (e4m3, one scale per 96 values)" in _refused(
        ["features", "convert", str(new), "--store-dtype", "fp8", "--fp8-block", "128", "--out", str(tmp_path / "x")], capsys)
    # the block store flushes no more than the old one, of the very same captured values
    def flushed(store):
        n = 0
        for i in range(len(src)):
            a, b = src[i]["aux_hidden_states"], store[i]["aux_hidden_states"]
            n += int(((a != 0) & (b == 0)).sum())
        return n
    assert flushed(FeatureStore(fp8_store)) <= flushed(fs)
    # stores of two schemes never merge
    err = _refused(["features", "merge", str(old), str(fp8_store), "--out", str(tmp_path / "m")], capsys)
    assert re.search(r"fp8_block: \S+ has 576, \S+ has 96", err), err


def test_store_dtype_auto_keeps_an_fp32_run_in_fp32(tmp_path, capsys):
    """`--store-dtype auto` picks fp8 for wide targets run in bf16 only: `--dtype fp32` keeps fp32, and
    the resolved store dtype is printed at start (plan and real capture alike)."""
    from eaglenest.capture.run import resolve_store_dtype

    assert resolve_store_dtype("auto", "bf16", 7168)[0] == "fp8"
    assert resolve_store_dtype("auto", "fp32", 7168)[0] == "fp32"
    assert resolve_store_dtype("auto", "bf16", 576)[0] == "bf16"
    assert resolve_store_dtype("fp8", "fp32", 576)[0] == "fp8"
    kimi = _config_only(tmp_path, 7168, 61)
    for extra, chosen, why in ((["--dtype", "fp32"], "fp32", "auto: the target runs in fp32"),
                               (["--dtype", "fp32", "--store-dtype", "fp8"], "fp8 (e4m3, one scale per 128 values)", "--store-dtype"),
                               ([], "fp8 (e4m3, one scale per 128 values)", "auto: hidden size 7168 >= 4096")):
        capsys.readouterr()
        main(["capture", "--model", str(kimi), "--out", str(tmp_path / "f"), "--dry-run", "--tokens", "1000", *extra])
        err = capsys.readouterr().err
        assert f"store dtype {chosen} ({why}" in err, err
        mark = [line.split()[0] for line in err.splitlines() if line.endswith("<- this run")]
        assert mark == [chosen.split()[0]], err


def test_capture_fp32_on_a_wide_target_stores_fp32(tiny_llama_dir, smol_data, tmp_path, monkeypatch):
    """The real capture path: a target counted as wide (the threshold lowered to the tiny model's
    hidden size) stores fp8 when run in bf16 and fp32 when run in fp32."""
    import eaglenest.capture.run as cr

    monkeypatch.setattr(cr, "COMPACT_FROM_HIDDEN", 64)
    for dtype, stored in (("bf16", "fp8"), ("fp32", "fp32")):
        out = tmp_path / dtype
        assert main(["capture", "--model", str(tiny_llama_dir), "--data", str(smol_data), "--out", str(out), "--limit", "2",
                     "--device", "cpu", "--dtype", dtype]) == 0
        fs = FeatureStore(out)
        assert fs.meta.dtype == stored and fs[0]["aux_hidden_states"].dtype == (torch.float32 if stored == "fp32" else torch.bfloat16)


def test_a_store_never_mixes_states_computed_in_two_dtypes(tiny_llama_dir, smol_data, tmp_path, capsys):
    """`capture --dtype auto` computes in bf16 on a CPU with bf16 matrix instructions and in fp32 on
    one without, storing bf16 either way (the two --dtype values below are what it picks on each).
    The compute dtype is part of a store's identity: a resume or a merge across the two is refused,
    naming the store.  A store written before the field reads as 'not recorded' and takes a resume."""
    cap = ["capture", "--model", str(tiny_llama_dir), "--data", str(smol_data), "--device", "cpu", "--store-dtype", "bf16"]
    amx, avx2 = tmp_path / "amx", tmp_path / "avx2"
    assert main([*cap, "--out", str(amx), "--limit", "3", "--dtype", "bf16"]) == 0
    assert main([*cap, "--out", str(avx2), "--limit", "6", "--dtype", "fp32"]) == 0
    assert [json.loads((d / "store.json").read_text())["compute_dtype"] for d in (amx, avx2)] == ["bf16", "fp32"]
    assert FeatureStore(amx).meta.dtype == FeatureStore(avx2).meta.dtype == "bf16"  # what the old identity compared
    err = _refused([*cap, "--out", str(amx), "--limit", "5", "--dtype", "fp32"], capsys)
    assert f"{amx} holds features from a different setup (compute_dtype: store has 'bf16', this run 'fp32'" in err, err
    assert "--dtype bf16" in err and len(FeatureStore(amx)) == 3
    err = _refused(["features", "merge", str(amx), str(avx2), "--out", str(tmp_path / "X")], capsys)
    assert f"{amx} has 'bf16', {avx2} has 'fp32'" in err and not (tmp_path / "X").exists(), err

    old = tmp_path / "old"  # as written before the field existed
    shutil.copytree(amx, old)
    st = json.loads((old / "store.json").read_text())
    del st["compute_dtype"]
    (old / "store.json").write_text(json.dumps(st))
    assert FeatureStore(old).meta.compute_dtype is None and len(FeatureStore(old)) == 3
    capsys.readouterr()
    assert main([*cap, "--out", str(old), "--limit", "5", "--dtype", "fp32"]) == 0
    assert "does not record the dtype its states were computed in" in capsys.readouterr().err
    assert len(FeatureStore(old)) == 5 and "compute_dtype" not in json.loads((old / "store.json").read_text())
    # (old's bf16-computed samples differ from avx2's under the same ids: --on-collision skip keeps one)
    assert main(["features", "merge", str(old), str(avx2), "--out", str(tmp_path / "M"), "--on-collision", "skip"]) == 0
    assert "compute_dtype" not in json.loads((tmp_path / "M" / "store.json").read_text())  # not recorded either
