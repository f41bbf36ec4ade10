"""The SGLang client end to end against a PROTOCOL STAND-IN (tests/sglang_standin.py: a real HTTP
server on 127.0.0.1 implementing SGLang 0.5.23's `/generate` contract over a transformers target --
not SGLang).  Plugin-mode dumps come from eaglenest's own capture plugin running inside the
stand-in.  Captured features must match `--engine hf` on the same samples; faults (wrong prompt
length, 5xx, timeouts, missing dumps) must end as counted failures with reasons."""

from __future__ import annotations

import json
import random

import pytest
import torch

from eaglenest import EaglenestError
from eaglenest.cli import main
from eaglenest.engines.sglang import plugin
from eaglenest.engines.base import Captured, Failure, Generated, Request
from eaglenest.engines.sglang.engine import SGLangEngine
from eaglenest.features import FeatureStore
from sglang_standin import SGLangStandIn

N_SAMPLES = 7


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, tiny_llama_dir):
    from eaglenest.data.store import Sample, write_prepared

    rng = random.Random(0)
    out = tmp_path_factory.mktemp("sgl_data")
    samples = []
    for i in range(N_SAMPLES):
        n = rng.randint(6, 40)
        k = rng.randint(2, n - 2)
        samples.append(Sample(f"s{i}", [rng.randrange(3, 49152) for _ in range(n)], [0] * k + [1] * (n - k)))
    write_prepared(out, samples, {"target": str(tiny_llama_dir), "max_length": 128}, vocab_size=49152)
    return out


@pytest.fixture(scope="module")
def hf_store(tiny_llama_dir, data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("sgl_hf") / "f"
    assert main(["capture", "--model", str(tiny_llama_dir), "--data", str(data_dir), "--out", str(out), "--engine", "hf",
                 "--device", "cpu", "--dtype", "fp32", "--batch-tokens", "256"]) == 0
    return out


@pytest.fixture
def standin(tiny_llama_dir, tmp_path):
    servers = []

    def start(kind="plugin", staging=None, **kw):
        s = SGLangStandIn(tiny_llama_dir, kind=kind, staging=staging or tmp_path / "staging", **kw).start()
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.stop()


def stores_match(a, b):
    fa, fb = FeatureStore(a), FeatureStore(b)
    assert len(fa) == len(fb) == N_SAMPLES
    assert fa.meta.layer_ids == fb.meta.layer_ids and fa.meta.final_norm == fb.meta.final_norm == "post"
    tb = {fb[i]["id"]: fb[i] for i in range(len(fb))}
    for i in range(len(fa)):
        x = fa[i]
        y = tb[x["id"]]
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
        torch.testing.assert_close(x["aux_hidden_states"], y["aux_hidden_states"], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(x["last_hidden_state"], y["last_hidden_state"], rtol=1e-4, atol=1e-4)


def test_plugin_capture_matches_hf_engine(tiny_llama_dir, data_dir, hf_store, standin, tmp_path):
    staging = tmp_path / "staging"
    s1, s2 = standin(staging=staging), standin(staging=staging)  # two servers, one staging dir
    out = tmp_path / "sgl"
    assert main(["capture", "--model", str(tiny_llama_dir), "--data", str(data_dir), "--out", str(out),
                 "--engine", "sglang", "--sglang-url", s1.url, "--sglang-url", s2.url, "--sglang-staging", str(staging),
                 "--sglang-batch", "2", "--sglang-concurrency", "2", "--dtype", "fp32", "--batch-tokens", "256"]) == 0
    stores_match(out, hf_store)
    assert s1.requests and s2.requests, "requests are spread over the URLs"
    sent = s1.requests + s2.requests
    assert all("prompt_token_ids" not in b and len(b["input_ids"]) <= 2 for b in sent)
    keys = [k for b in sent for k in b["extra_key"]]
    assert len(set(keys)) == len(keys) == N_SAMPLES
    assert all(b["sampling_params"] == {"max_new_tokens": 1, "temperature": 0.0} for b in sent)
    assert sorted(p.name for p in staging.iterdir()) == [plugin.MARKER_FILE], "dumps are deleted once stored"


def test_stock_mode(tiny_llama_dir, data_dir, hf_store, standin, tmp_path, capsys):
    final = standin(kind="final")
    base = ["capture", "--model", str(tiny_llama_dir), "--data", str(data_dir), "--engine", "sglang", "--sglang-mode",
            "stock", "--sglang-url", final.url, "--dtype", "fp32", "--batch-tokens", "256"]
    assert main(base + ["--out", str(tmp_path / "no")]) == 2
    err = capsys.readouterr().err
    assert "returns only the post-norm final state" in err and "--sglang-aux-url" in err
    aux = standin(kind="aux")
    out = tmp_path / "stock"
    assert main(base + ["--out", str(out), "--sglang-aux-url", aux.url]) == 0
    stores_match(out, hf_store)
    assert all(b.get("return_hidden_states") is True for b in final.requests + aux.requests)
    # not the plugin's rid prefix: a server that also runs the plugin leaves no staging files for them
    assert all(r.startswith("eaglenest-stock-") for b in final.requests + aux.requests for r in b["rid"])


FIVE = "2,3,4,5,6"  # spread_layer_ids(8, 5): a DFlash layer set on the 8-layer target


def test_five_layers_through_plugin_and_stock_servers(tiny_llama_dir, data_dir, standin, tmp_path, capsys):
    """Any number of layers: the plugin writes [T, 5H], stock aux servers return it, both equal the hf
    engine's five-layer store; an aux server that captures other layers is refused by the preflight,
    which reads its ids from /server_info and says which ids to start it with."""
    five = [int(k) for k in FIVE.split(",")]
    hf = tmp_path / "hf5"
    assert main(["capture", "--model", str(tiny_llama_dir), "--data", str(data_dir), "--out", str(hf), "--engine", "hf",
                 "--device", "cpu", "--dtype", "fp32", "--batch-tokens", "256", "--layers", FIVE]) == 0
    assert FeatureStore(hf).meta.layer_ids == five and FeatureStore(hf)[0]["aux_hidden_states"].shape[1] == 5 * 64
    staging = tmp_path / "staging5"
    s = standin(staging=staging, layer_ids=five)
    common = ["--model", str(tiny_llama_dir), "--data", str(data_dir), "--engine", "sglang", "--dtype", "fp32",
              "--batch-tokens", "256", "--layers", FIVE]
    assert main(["capture", *common, "--out", str(tmp_path / "plugin5"), "--sglang-url", s.url, "--sglang-staging", str(staging)]) == 0
    stores_match(tmp_path / "plugin5", hf)
    final, aux = standin(kind="final"), standin(kind="aux", layer_ids=five)
    assert aux.info["return_aux_hidden_state_layer_ids"] == [1, 2, 3, 4, 5]  # output-of: SGLang's Llama rule adds 1
    stock = ["capture", *common, "--sglang-mode", "stock", "--sglang-url", final.url]
    assert main([*stock, "--out", str(tmp_path / "stock5"), "--sglang-aux-url", aux.url]) == 0
    stores_match(tmp_path / "stock5", hf)
    canonical = standin(kind="aux")  # captures the default three
    capsys.readouterr()
    assert main([*stock, "--out", str(tmp_path / "wrong"), "--sglang-aux-url", canonical.url]) == 2
    err = capsys.readouterr().err
    assert "captures before layers [2, 4, 5] (ids [1, 3, 4]), this run wants [2, 3, 4, 5, 6]" in err
    assert "--return-aux-hidden-state-layer-ids 1 2 3 4 5" in err and not (tmp_path / "wrong" / "manifest.jsonl").exists()


def engine(tiny_llama_dir, url, staging, **kw):
    kw.setdefault("backoff", 0.01)
    return SGLangEngine(tiny_llama_dir, urls=[url], staging=staging, **kw)


REQS = [Request("a", [5, 6, 7, 8, 9]), Request("b", [10, 11, 12])]


def test_wrong_prompt_length_is_token_mismatch(tiny_llama_dir, standin, tmp_path):
    s = standin()
    s.prompt_tokens_offset = 1
    with engine(tiny_llama_dir, s.url, tmp_path / "staging") as e:
        res = e.capture(REQS)
        gen = e.generate(REQS, 4)
    assert [type(r) for r in res] == [Failure, Failure] and {r.reason for r in res} == {"token_mismatch"}
    assert "server reports 6 prompt tokens, 5 were sent" in res[0].message
    assert {g.reason for g in gen} == {"token_mismatch"}
    s.observer.writer.flush()
    assert [p.name for p in (tmp_path / "staging").iterdir()] == [plugin.MARKER_FILE]


def test_5xx_then_success(tiny_llama_dir, standin, tmp_path):
    s = standin()
    s.fail_next = [503, 502]
    with engine(tiny_llama_dir, s.url, tmp_path / "staging", retries=3) as e:
        res = e.capture(REQS)
    assert all(isinstance(r, Captured) for r in res)
    assert len(s.requests) == 1  # the two failed attempts never reached the model
    s.fail_next = [503] * 3
    with engine(tiny_llama_dir, s.url, tmp_path / "staging", retries=2) as e:
        res = e.capture(REQS[:1])
    assert res[0].reason == "http_5xx" and "after 3 attempts" in res[0].message


def test_one_bad_sample_does_not_fail_its_batch(tiny_llama_dir, standin, tmp_path):
    s = standin()
    s.context_len = 6
    reqs = [Request("ok1", [1, 2, 3]), Request("long", list(range(10, 20))), Request("ok2", [4, 5])]
    with engine(tiny_llama_dir, s.url, tmp_path / "staging") as e:
        res = e.capture(reqs)
    assert isinstance(res[0], Captured) and isinstance(res[2], Captured)
    assert res[1].reason == "too_long" and "context length" in res[1].message


def test_timeout_is_a_failure_with_reason(tiny_llama_dir, standin, tmp_path):
    s = standin()
    s.delay_next = [2.0]
    with engine(tiny_llama_dir, s.url, tmp_path / "staging", timeout=0.5, retries=0) as e:
        res = e.capture(REQS[:1])
    # a client that waited for the late answer would have it (a Captured): the failure is the timeout's
    assert isinstance(res[0], Failure) and res[0].reason == "timeout"
    assert "timed out" in res[0].message and "after 1 attempts" in res[0].message
    s.delay_next = [2.0]
    with engine(tiny_llama_dir, s.url, tmp_path / "staging", timeout=0.5, retries=1) as e:  # retry wins
        assert isinstance(e.capture(REQS[:1])[0], Captured)


def test_missing_dumps_and_preflight(tiny_llama_dir, standin, tmp_path):
    staging = tmp_path / "staging"
    plain = standin(kind="plain")
    with engine(tiny_llama_dir, plain.url, staging) as e:  # no plugin marker: refused up front
        with pytest.raises(EaglenestError, match="not running eaglenest's capture plugin"):
            e.capture(REQS)
    plugin.Observer(str(staging)).write_marker()  # a marker, but the server writes nothing
    with engine(tiny_llama_dir, plain.url, staging, dump_timeout=0.3) as e:
        res = e.capture(REQS[:1])
    assert res[0].reason == "staging_missing" and "--cuda-graph-backend-prefill disabled" in res[0].message
    bad = standin(server_info={"cuda_graph_config": {"prefill": {"backend": "breakable"}}})
    with engine(tiny_llama_dir, bad.url, staging) as e:
        with pytest.raises(EaglenestError, match="prefill CUDA graph"):
            e.capture(REQS)
    with engine(tiny_llama_dir, bad.url, tmp_path / "staging", layers="2,3,5") as e:
        with pytest.raises(EaglenestError, match="canonical layers"):
            e._check_marker()


def test_chunks_are_assembled_and_cached_prefixes_refused(tiny_llama_dir, tmp_path):
    staging = tmp_path / "staging"
    w = plugin.DumpWriter(str(staging), threaded=False)
    H, ids = 64, list(range(100, 110))
    aux, last = torch.randn(10, 3 * H), torch.randn(10, H)
    with SGLangEngine(tiny_llama_dir, urls=["http://127.0.0.1:9"], staging=staging, dump_timeout=0.2) as e:
        lids = e.layer_ids
        w.dump("eaglenest-cap-c1", 0, torch.tensor(ids[:4]), aux[:4], last[:4], lids)
        w.dump("eaglenest-cap-c1", 4, torch.tensor(ids[4:]), aux[4:], last[4:], lids)
        got = e._collect("eaglenest-cap-c1", Request("x", ids))
        assert isinstance(got, Captured) and torch.equal(got.aux_hidden_states, aux) and torch.equal(got.last_hidden_state, last)
        w.dump("eaglenest-cap-c2", 3, torch.tensor(ids[3:]), aux[3:], last[3:], lids)
        assert e._collect("eaglenest-cap-c2", Request("y", ids)).reason == "prefix_cached"
        w.dump("eaglenest-cap-c3", 0, torch.tensor(ids[:4]), aux[:4], last[:4], lids)
        assert e._collect("eaglenest-cap-c3", Request("z", ids)).reason == "staging_incomplete"
        w.dump("eaglenest-cap-c4", 0, torch.tensor([1] + ids[1:]), aux, last, lids)
        assert e._collect("eaglenest-cap-c4", Request("t", ids)).reason == "token_mismatch"
        w.dump("eaglenest-cap-c5", 0, torch.tensor(ids), aux, last, [1, 2, 3])
        assert e._collect("eaglenest-cap-c5", Request("u", ids)).reason == "layer_mismatch"
        w.error(["eaglenest-cap-c6"], "tbo_unobservable", "two-batch overlap")
        f = e._collect("eaglenest-cap-c6", Request("v", ids))
        assert f.reason == "tbo_unobservable" and "capture plugin" in f.message


def test_generate_matches_hf_and_regenerate_runs(tiny_llama_dir, data_dir, standin, tmp_path):
    from eaglenest.engines.hf import HFEngine

    s = standin(kind="plain")
    reqs = [Request("a", [1, 5, 9, 200, 3000]), Request("b", [7, 8, 9])]
    with engine(tiny_llama_dir, s.url, tmp_path / "st") as e:
        got = e.generate(reqs, 6, temperature=0.0)
    with HFEngine(str(tiny_llama_dir), dtype="fp32", device="cpu") as h:
        ref = h.generate(reqs, 6, temperature=0.0)
    assert all(isinstance(g, Generated) for g in got)
    assert [g.output_ids for g in got] == [r.output_ids for r in ref]
    assert [g.prompt_ids for g in got] == [r.input_ids for r in reqs]
    body = s.requests[-1]
    assert body["sampling_params"]["stop_token_ids"] == [2] and "extra_key" not in body
    out = tmp_path / "regen"
    assert main(["regenerate", "--model", str(tiny_llama_dir), "--data", str(data_dir), "--out", str(out),
                 "--engine", "sglang", "--sglang-url", s.url, "--temperature", "0", "--max-new-tokens", "5",
                 "--limit", "3"]) == 0
    rows = [json.loads(x) for x in (out / "regenerate.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(r["generated_tokens"] > 0 for r in rows)


HF_REPORT_KEYS = {
    "engine", "dataset", "n_prompts", "turns", "n_generations", "steps", "topk", "num_draft_tokens", "temperature",
    "batch_size", "max_new_tokens", "seed", "target", "target_path", "draft", "aux_layer_ids", "draft_vocab_size",
    "device", "dtype", "tau", "generated_tokens", "verified_tokens", "verify_steps", "accept_per_position",
    "spec_wall_s", "spec_tokens_per_s", "baseline_tokens", "baseline_wall_s", "baseline_tokens_per_s", "speedup",
    "greedy_matches_baseline", "greedy_mismatches", "per_prompt", "date", "elapsed_s", "machine",
}


def test_eval_tau_from_meta_info(tiny_llama_dir, standin, tmp_path):
    spec = standin(kind="plain", spec_steps=3, server_info={"speculative_algorithm": "EAGLE3", "speculative_num_steps": 3,
                                                            "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4})
    base = standin(kind="plain")
    bench = tmp_path / "bench.jsonl"
    bench.write_text("\n".join(json.dumps({"question_id": i, "turns": [q]}) for i, q in
                               enumerate(["Hello there", "What is two plus two?", "Name a colour."])) + "\n")
    report = tmp_path / "REPORT.json"
    argv = ["eval", "--model", str(tiny_llama_dir), "--draft", str(tmp_path / "draft-on-server"), "--out", str(report),
            "--engine", "sglang", "--engine-arg", f"url={spec.url}", "--engine-arg", f"baseline_url={base.url}",
            "--bench", str(bench), "--max-new-tokens", "12"]
    assert main(argv) == 0
    r = json.loads(report.read_text())
    assert HF_REPORT_KEYS <= set(r), HF_REPORT_KEYS - set(r)
    assert r["engine"] == "sglang" and r["n_generations"] == 3 and r["greedy_matches_baseline"] is True
    assert r["verified_tokens"] == r["generated_tokens"]  # completion tokens
    assert r["tau"] == pytest.approx(r["generated_tokens"] / r["verify_steps"])
    assert r["sglang_tau_verify_only"] == pytest.approx((r["generated_tokens"] - 3) / r["verify_steps"])
    assert len(r["accept_per_position"]) == 3 and r["sglang_version"] == "0.5.23"
    assert main(argv + ["--steps", "5"]) == 2  # the server decodes with 3 steps


def test_eval_stops_at_every_stop_id_of_a_qwen25_style_generation_config(tiny_llama_dir, tmp_path):
    """Qwen2.5 ships one eos in config.json and two in generation_config.json ([<|im_end|>,
    <|endoftext|>]).  eval --engine sglang reads the target's stop ids where hf and vLLM do
    (models.target.eos_token_ids), so an answer ends at the generation_config-only id.  The stand-in
    serves the target without that file: it stops only where the request's stop_token_ids say."""
    import shutil

    from eaglenest.engines.hf import HFEngine
    from eaglenest.evaluate.run import chat_prompt_ids
    from eaglenest.models.target import load_tokenizer
    from helpers_eval import load_tiny

    served = tmp_path / "served"
    shutil.copytree(tiny_llama_dir, served)
    load_tiny(tiny_llama_dir).save_pretrained(served)  # re-drawn weights: the default init repeats one token
    question = "Name a colour."
    ids = chat_prompt_ids(load_tokenizer(str(served)), [{"role": "user", "content": question}])
    with HFEngine(str(served), dtype="fp32", device="cpu") as h:
        ref = h.generate([Request("q", ids)], 12, temperature=0.0)[0].output_ids
    cut = next(i for i in range(2, len(ref)) if ref[i] not in ref[:i] and ref[i] != 2)  # config.json's eos is 2
    target = tmp_path / "qwen25-like"
    shutil.copytree(served, target)
    (target / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, ref[cut]]}))
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"question_id": 0, "turns": [question]}) + "\n")
    report = tmp_path / "REPORT.json"
    spec = SGLangStandIn(served, kind="plain", staging=tmp_path / "staging", spec_steps=3,
                         server_info={"speculative_algorithm": "EAGLE3", "speculative_num_steps": 3,
                                      "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4}).start()
    try:
        assert main(["eval", "--model", str(target), "--draft", str(tmp_path / "draft-on-server"), "--out", str(report),
                     "--engine", "sglang", "--engine-arg", f"url={spec.url}", "--bench", str(bench),
                     "--max-new-tokens", "12"]) == 0
    finally:
        spec.stop()
    (rec,) = json.loads(report.read_text())["per_prompt"]
    assert rec["output_ids"] == ref[: cut + 1] and rec["finish_reason"] == "stop", (ref, cut, rec["output_ids"])
    assert sorted(spec.requests[-1]["sampling_params"]["stop_token_ids"]) == [2, ref[cut]]


def test_cli_needs_a_url(tiny_llama_dir, data_dir, tmp_path, capsys):
    assert main(["capture", "--model", str(tiny_llama_dir), "--data", str(data_dir), "--out", str(tmp_path / "o"),
                 "--engine", "sglang"]) == 2
    assert "--sglang-url" in capsys.readouterr().err


def test_sglang_serve_refuses_mla_targets(tmp_path, capsys):
    """SGLang 0.5.23's CPU engine computes MLA prefill attention over the latent KV cache (docs/sglang.md):
    `--sglang-serve` refuses DeepSeek-family targets before starting anything; a URL is still accepted."""
    from family_helpers import tiny_deepseek

    from eaglenest.engines.sglang.engine import SGLangEngine
    from eaglenest.models.fetch import fetch

    ds = tiny_deepseek(tmp_path / "ds", tokenizer_from=fetch("smollm2"), layers=6)
    with pytest.raises(EaglenestError, match="MLA attention.*cannot be served correctly by SGLang"):
        SGLangEngine(ds, serve=True)
    SGLangEngine(ds, urls=["http://127.0.0.1:9"], preflight=False).close()  # a GPU server of the user's: not refused
