"""Live: vLLM (CPU) captures the same EAGLE-3 features as transformers, on the real SmolLM2.

vLLM runs `extract_hidden_states` with our CPU connector; we compare its feature store with the
HF engine's for the same prepared samples: identical token ids, per-token cosine per aux layer,
and the teacher distribution (vLLM's pre-norm final state -> final norm + lm_head; HF's post-norm
state -> lm_head).  fp32 is the semantic check (the two implementations must agree to rounding);
bf16 is what users run (two bf16 implementations drift by a few 1e-3 in cosine on some tokens).
"""

from __future__ import annotations

import json

import pytest

from vllm_helpers import compare_features, make_tiny_data, requires_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow, requires_vllm]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, smollm2):
    return make_tiny_data(tmp_path_factory.mktemp("vllm_data"), str(smollm2), n=4, max_length=256)


def _hf_capture(smollm2, data_dir, out, dtype, layers="auto"):
    from eaglenest.capture.run import run_capture
    from eaglenest.data import PreparedData
    from eaglenest.engines.hf import HFEngine

    with HFEngine(str(smollm2), layers=layers, dtype=dtype, device="cpu") as e:
        s = run_capture(e, PreparedData(data_dir), out, dtype=dtype)
    assert s.failed == 0
    return out


def test_capture_equivalence_bf16_through_the_cli(smollm2, data_dir, tmp_path):
    """`eaglenest capture --engine vllm` (starts and stops its own server) vs `--engine hf`."""
    from eaglenest.cli import main

    out = tmp_path / "vllm"
    log = tmp_path / "server.log"
    rc = main(["capture", "--model", str(smollm2), "--data", str(data_dir), "--out", str(out), "--engine", "vllm",
               "--vllm-serve", "--vllm-log", str(log)])
    assert rc == 0, log.read_text()[-3000:]
    hf = _hf_capture(smollm2, data_dir, tmp_path / "hf", "bf16")
    r = compare_features(out, hf, smollm2, "bf16")
    print("bf16 capture agreement:", json.dumps(r))
    assert r["ids_equal"] and r["samples"] == 4
    for k in range(3):
        assert r["cos_mean"][k] >= 0.9995, r
        assert r["cos_frac_ge_0.999"][k] >= 0.98, r
        assert r["cos_min"][k] >= 0.99, r
    assert r["teacher_kl_mean"] <= 0.01 and r["teacher_argmax_agree"] >= 0.95, r


FIVE = "2,9,15,21,28"  # spread_layer_ids(30, 5): DFlash's default five layers on SmolLM2


def test_capture_equivalence_fp32(smollm2, data_dir, tmp_path):
    """Same check in fp32, at five layers (vLLM's extract_hidden_states takes any number of ids): every
    token of every aux layer at cosine >= 0.9999 (the brief asks 0.999); the server listens on
    127.0.0.1 only (read from the kernel, not from its log)."""
    from eaglenest.capture.run import run_capture
    from eaglenest.data import PreparedData
    from eaglenest.engines.vllm import VLLMEngine

    from netcheck import listen_addresses

    with VLLMEngine(str(smollm2), dtype="fp32", layers=FIVE) as e:
        s = run_capture(e, PreparedData(data_dir), tmp_path / "vllm", dtype="fp32")
        start = e.server.start_seconds if e.server else None
        bound = listen_addresses(e.server.port)  # what the kernel says the server listens on
    assert bound == {"127.0.0.1"}, bound
    assert s.failed == 0 and s.stored == 4
    hf = _hf_capture(smollm2, data_dir, tmp_path / "hf", "fp32", layers=FIVE)
    r = compare_features(tmp_path / "vllm", hf, smollm2, "fp32")
    assert r["layer_ids"] == [2, 9, 15, 21, 28] and len(r["cos_min"]) == 5
    print(f"fp32 capture agreement (server start {start:.1f}s):", json.dumps(r))
    assert r["ids_equal"]
    assert min(r["cos_min"]) >= 0.9999, r
    assert r["teacher_prob_maxdiff"] <= 1e-3 and r["teacher_argmax_agree"] >= 0.999, r
    # the store says pre-norm, and applying the norm was what made the teachers agree
    assert json.loads((tmp_path / "vllm" / "store.json").read_text())["final_norm"] == "pre"
