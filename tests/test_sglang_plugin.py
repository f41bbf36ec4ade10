"""eaglenest's SGLang capture plugin, run on transformers' LlamaModel and DeepseekV2Model layers
arranged in SGLang 0.5.23's calling structure (tests/sglang_shapes.py; SGLang itself cannot run
here).  The captured aux states and final state must equal transformers' `output_hidden_states`
(capture-before: aux id k = hidden_states[k]; final = post-norm last_hidden_state), the model's
return value must be untouched, SGLang's own aux capture must keep working, and what cannot be
observed (two-batch overlap) must be reported as an error, never as partial data."""

from __future__ import annotations

import json
import os

import pytest
import torch

from eaglenest.engines.sglang import plugin
from sglang_shapes import ForwardMode, ShapedModel, pack, tiny_deepseek_v2, tiny_llama

REQS = [[5, 17, 3, 88, 42, 9, 61, 7], [11, 2, 30], [70, 71, 72, 73, 74]]
LAYERS = [2, 3, 4]  # capture-before ids in a 6-layer model (canonical would be [2, 3, 3]: not increasing)

CASES = {"llama": (tiny_llama, plugin.LLAMA), "deepseek_v2": (tiny_deepseek_v2, plugin.DEEPSEEK_V2)}


def run(observer, spec, model, reqs, rids, **kw):
    ids, pos, fb = pack(reqs, rids, **kw)
    with torch.no_grad():
        out = observer.around(spec, ShapedModel.forward, model, ids, pos, fb)
    observer.writer.flush()
    return out


def reference(hf, reqs):
    with torch.no_grad():
        return [hf(torch.tensor([r]), output_hidden_states=True) for r in reqs]


def make(tmp_path, flavour, layer_ids=LAYERS):
    build, spec = CASES[flavour]
    hf = build()
    model = ShapedModel(hf, flavour)
    obs = plugin.Observer(str(tmp_path), layer_ids=layer_ids, sglang_version="0.5.23", rank_fn=lambda: 0,
                          writer=plugin.DumpWriter(str(tmp_path), threaded=True))
    return hf, model, spec, obs


@pytest.mark.parametrize("flavour", sorted(CASES))
def test_capture_equals_output_hidden_states(tmp_path, flavour):
    hf, model, spec, obs = make(tmp_path, flavour)
    rids = ["eaglenest-cap-a", "other-request", "eaglenest-cap-c"]  # the middle one is not ours
    plain = run(plugin.Observer(str(tmp_path / "unused"), rid_prefix="nobody-"), spec, model, REQS, rids)
    out = run(obs, spec, model, REQS, rids)
    assert torch.equal(out, plain), "the observed forward must return exactly what the plain forward returns"
    refs = reference(hf, REQS)
    assert not (tmp_path / plugin.dump_name("other-request", 0)).exists()
    for j in (0, 2):
        t, meta = plugin.read_dump(str(tmp_path / plugin.dump_name(rids[j], 0)))
        assert meta["rid"] == rids[j] and meta["start"] == "0" and int(meta["n_tokens"]) == len(REQS[j])
        assert json.loads(meta["layer_ids"]) == LAYERS and meta["final_norm"] == "post" and meta["dtype"] == "float32"
        assert meta["convention"] == "capture-before" and meta["model_class"] == "ShapedModel"
        assert t["input_ids"].tolist() == REQS[j]
        hs = refs[j].hidden_states
        H = hf.config.hidden_size
        for n, k in enumerate(LAYERS):
            got = t["aux_hidden_states"][:, n * H:(n + 1) * H]
            torch.testing.assert_close(got, hs[k][0], rtol=1e-5, atol=1e-5)
            # and it is not the neighbouring layer (an off-by-one would pass a loose check)
            assert (got - hs[k + 1][0]).abs().max() > 1e-3
        torch.testing.assert_close(t["last_hidden_state"], refs[j].last_hidden_state[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("flavour", sorted(CASES))
def test_sglang_own_aux_capture_keeps_working(tmp_path, flavour):
    """A server serving EAGLE-3 captures aux layers itself (layers_to_capture); the plugin chains
    onto that capture: SGLang still gets its tensors, unchanged, and so do we."""
    hf, model, spec, obs = make(tmp_path, flavour)
    model.layers_to_capture = [2, 3, 5]  # SGLang's own choice, overlapping ours on 2 and 3
    rids = ["eaglenest-cap-x", "eaglenest-cap-y", "eaglenest-cap-z"]
    plain_final, plain_aux = run(plugin.Observer(str(tmp_path / "u"), rid_prefix="nobody-"), spec, model, REQS, rids)
    final, aux = run(obs, spec, model, REQS, rids)
    assert torch.equal(final, plain_final) and torch.equal(aux, plain_aux)
    assert aux.shape[-1] == 3 * hf.config.hidden_size
    refs = reference(hf, REQS)
    t, _ = plugin.read_dump(str(tmp_path / plugin.dump_name("eaglenest-cap-y", 0)))
    torch.testing.assert_close(t["aux_hidden_states"][:, :hf.config.hidden_size], refs[1].hidden_states[2][0],
                               rtol=1e-5, atol=1e-5)


def test_two_batch_overlap_is_reported_not_written(tmp_path):
    """DeepseekV2 under TBO runs the layers from first_k_dense_replace (2) through a path without a
    capture argument: aux layers 2..4 cannot be observed -> an error file, no dump."""
    hf, model, spec, obs = make(tmp_path, "deepseek_v2")
    rids = ["eaglenest-cap-t0", "eaglenest-cap-t1", "eaglenest-cap-t2"]
    plain = run(plugin.Observer(str(tmp_path / "u"), rid_prefix="nobody-"), spec, model, REQS, rids, tbo=True)
    out = run(obs, spec, model, REQS, rids, tbo=True)
    assert torch.equal(out, plain)
    for rid in rids:
        assert not list(tmp_path.glob(f"{rid}.*.safetensors"))
        err = json.loads((tmp_path / plugin.error_name(rid)).read_text())
        assert err["reason"] == "tbo_unobservable" and "two-batch overlap" in err["message"]


def test_an_unreadable_rank_writes_an_error_not_rank_0_data(tmp_path):
    """Without SGLang's runtime_context (here: no sglang at all) the rank is unknown: the plugin
    must not act as rank 0 (at TP > 1 every rank would write the same files)."""
    hf, model, spec, _ = make(tmp_path, "llama")
    obs = plugin.Observer(str(tmp_path), layer_ids=LAYERS, writer=plugin.DumpWriter(str(tmp_path), threaded=False))
    out = run(obs, spec, model, REQS, ["eaglenest-cap-r0", "eaglenest-cap-r1", "eaglenest-cap-r2"])
    assert out.shape[0] == sum(map(len, REQS))
    assert not list(tmp_path.glob("*.safetensors"))
    err = json.loads((tmp_path / plugin.error_name("eaglenest-cap-r1")).read_text())
    assert err["reason"] == "tp_rank_unknown" and "sglang" in err["message"]


def test_a_layer_that_never_reports_is_an_error(tmp_path):
    """If a layer runs without the capture argument (here: the plan thinks the loop covers every
    layer, but layer 4 goes through forward_stages), no partial file is written."""
    hf, model, spec, obs = make(tmp_path, "llama")
    orig = model.layers[4].forward
    model.layers[4].forward = lambda positions, h, fb, **kw: model.layers[4].forward_stages(h, fb)
    try:
        run(obs, spec, model, REQS, ["eaglenest-cap-m0", "eaglenest-cap-m1", "eaglenest-cap-m2"])
    finally:
        model.layers[4].forward = orig
    assert not list(tmp_path.glob("*.safetensors"))
    err = json.loads((tmp_path / plugin.error_name("eaglenest-cap-m1")).read_text())
    assert err["reason"] == "layer_not_observed" and "[4]" in err["message"]


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.IDLE])
def test_only_prefill_is_observed(tmp_path, mode):
    hf, model, spec, obs = make(tmp_path, "llama")
    ids, pos, fb = pack([[1], [2]], ["eaglenest-cap-d0", "eaglenest-cap-d1"], mode=mode)
    with torch.no_grad():
        obs.around(spec, ShapedModel.forward, model, ids, pos, fb)
    obs.writer.flush()
    assert os.listdir(tmp_path) == []


def test_chunked_prefill_and_mixed_batches(tmp_path):
    """A chunk that starts after token 0 (chunked prefill, or a radix-cache hit) is written with its
    start; the client decides whether the chunks cover the prompt."""
    hf, model, spec, obs = make(tmp_path, "llama")
    ids, pos, fb = pack(REQS[:2], ["eaglenest-cap-k0", "eaglenest-cap-k1"], mode=ForwardMode.MIXED)
    fb.extend_prefix_lens_cpu = [0, 4]
    with torch.no_grad():
        obs.around(spec, ShapedModel.forward, model, ids, pos, fb)
    obs.writer.flush()
    t, meta = plugin.read_dump(str(tmp_path / plugin.dump_name("eaglenest-cap-k1", 4)))
    assert meta["start"] == "4" and t["input_ids"].tolist() == REQS[1]


def test_nothing_breaks_the_forward(tmp_path):
    """Errors inside the hook become error files; the server's forward still returns normally."""
    hf, model, spec, obs = make(tmp_path, "llama")
    ids, pos, fb = pack(REQS, ["eaglenest-cap-e0", "eaglenest-cap-e1", "eaglenest-cap-e2"])
    fb.rids = fb.rids + ["eaglenest-cap-e3"]  # inconsistent with extend_seq_lens
    with torch.no_grad():
        out = obs.around(spec, ShapedModel.forward, model, ids, pos, fb)
    obs.writer.flush()
    assert out.shape == (sum(map(len, REQS)), hf.config.hidden_size)
    assert json.loads((tmp_path / plugin.error_name("eaglenest-cap-e0")).read_text())["reason"] == "bad_layout"


def test_patch_class_wraps_forward_once_and_keeps_original(tmp_path):
    class M(ShapedModel):
        forward = ShapedModel.forward

    obs = plugin.Observer(str(tmp_path), layer_ids=LAYERS, writer=plugin.DumpWriter(str(tmp_path), threaded=False),
                          rank_fn=lambda: 0)
    orig = M.__dict__["forward"]
    assert plugin.patch_class(M, plugin.LLAMA, obs) is True
    assert plugin.patch_class(M, plugin.LLAMA, obs) is False  # idempotent
    assert M.forward.__wrapped__ is orig and M.forward.__eaglenest_capture__
    hf = tiny_llama()
    m = M(hf, "llama")
    ids, pos, fb = pack(REQS[:1], ["eaglenest-cap-p0"])
    with torch.no_grad():
        out = m(ids, pos, fb)
    torch.testing.assert_close(out, reference(hf, REQS[:1])[0].last_hidden_state[0], rtol=1e-5, atol=1e-5)
    assert (tmp_path / plugin.dump_name("eaglenest-cap-p0", 0)).exists()


def test_post_import_patcher_and_register(tmp_path, monkeypatch):
    """register() is inert without EAGLENEST_SGLANG_CAPTURE_DIR; with it, a model module imported
    afterwards gets its class patched at import (here a fake `sglang.srt.models.llama`)."""
    import sys

    monkeypatch.delenv(plugin.ENV_DIR, raising=False)
    n_finders = len(sys.meta_path)
    plugin.register()
    assert len(sys.meta_path) == n_finders
    pkg = tmp_path / "pkgroot"
    mod = pkg / "sglang" / "srt" / "models"
    mod.mkdir(parents=True)
    for d in (pkg / "sglang", pkg / "sglang" / "srt", mod):
        (d / "__init__.py").write_text("")
    (mod / "llama.py").write_text("class LlamaDecoderLayer:\n    def forward(self, positions, h, fb, capture_output=None):\n"
                                  "        pass\n"
                                  "class LlamaModel:\n    def forward(self, *a, **k):\n        return 'original'\n")
    (mod / "deepseek_v2.py").write_text("class DeepseekV2DecoderLayer:\n    def forward(self, positions, h, fb):\n"
                                        "        pass\n"
                                        "class DeepseekV2Model:\n    def forward(self, *a, **k):\n        return 'x'\n")
    monkeypatch.setenv(plugin.ENV_DIR, str(tmp_path / "staging"))
    monkeypatch.syspath_prepend(str(pkg))
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        monkeypatch.delitem(sys.modules, name)
    try:
        plugin.register()
        marker = json.loads((tmp_path / "staging" / plugin.MARKER_FILE).read_text())
        assert marker["rid_prefix"] == plugin.DEFAULT_RID_PREFIX and marker["layer_ids"] == "auto"
        import sglang.srt.models.llama as fake

        assert fake.LlamaModel.forward.__eaglenest_capture__
        assert fake.LlamaModel().forward(None, None, None) == "original"  # no forward_batch: passes through
        import sglang.srt.models.deepseek_v2 as fake2  # its layer takes no capture argument: left alone

        assert not getattr(fake2.DeepseekV2Model.forward, "__eaglenest_capture__", False)
    finally:
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, plugin._PostImportPatcher)]
        for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
            del sys.modules[name]


def test_dump_files_are_written_atomically(tmp_path):
    w = plugin.DumpWriter(str(tmp_path), threaded=True)
    for i in range(5):
        w.dump(f"eaglenest-cap-w{i}", 0, torch.arange(4), torch.zeros(4, 6), torch.ones(4, 2), [1, 2, 3])
    w.error(["eaglenest-cap-bad"], "tbo_unobservable", "msg")
    w.flush()
    names = sorted(os.listdir(tmp_path))
    assert not [n for n in names if n.startswith(".")], "no temp files left behind"
    assert len([n for n in names if n.endswith(".safetensors")]) == 5 and "eaglenest-cap-bad.error.json" in names
    with pytest.raises(ValueError):
        plugin.encode_dump("r", 0, torch.arange(3), torch.zeros(4, 6), torch.ones(4, 2), [1, 2, 3])
