"""Live: a real SGLang 0.5.23 on the CPU (torch-native path, .venv-sglang) serving the real SmolLM2
target in fp32, started the way `--sglang-serve` starts it.

Two servers for the module: `main` (radix cache ON, eaglenest's capture plugin on its path,
`--enable-return-hidden-states`) and `aux` (radix cache OFF, SGLang's own aux capture:
`--enable-return-aux-hidden-states --speculative-algorithm EAGLE3 --return-aux-hidden-state-layer-ids
1 8 14 20 27`, five layers, no draft).  Checked: greedy output equals HF greedy and repeats are
identical (radix on and off); capture through the plugin equals the hf engine's features (cosine
>= 0.9999 per token) with the token echo checked and `prompt_token_ids` never sent; stock mode
(final state from `main`, the five-layer aux concat from `aux`) equals the hf engine's five-layer
capture, which also shows SGLang's Llama rule (ids + 1, as export/layer_ids.py says) live;
`regenerate --engine sglang` equals `--engine hf`; faults injected between client and server end as
retried-and-stored or recorded-with-reason, by the client's own account; the plugin reads the TP rank
from the real `sglang.srt.runtime_context`; the AMX gate is forced off.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from flaky_proxy import FlakyProxy, check_client_account
from sglang_live import REPO, chat_ids, hf_greedy, requires_sglang, served, sglang_python

pytestmark = [pytest.mark.sglang, pytest.mark.slow, requires_sglang]

QUESTIONS = ["What is the capital of France?", "Write a haiku about autumn leaves.", "List three prime numbers."]
N_NEW = 16
AUX_IDS = [1, 8, 14, 20, 27]  # output-of, as a draft's config would say: Llama adds 1 -> FIVE
FIVE = [2, 9, 15, 21, 28]  # spread_layer_ids(30, 5): DFlash's default layers on SmolLM2


@pytest.fixture(scope="module")
def staging(tmp_path_factory):
    return tmp_path_factory.mktemp("sgl_staging")


@pytest.fixture(scope="module")
def main_server(smollm2, staging, tmp_path_factory):
    with served(smollm2, tmp_path_factory.mktemp("sgl_main"), mode="generate", capture_dir=staging,
                extra=["--enable-return-hidden-states"]) as srv:
        yield srv.url


@pytest.fixture(scope="module")
def aux_server(smollm2, tmp_path_factory):
    extra = ["--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3",
             "--return-aux-hidden-state-layer-ids", *map(str, AUX_IDS), "--disable-radix-cache"]
    with served(smollm2, tmp_path_factory.mktemp("sgl_aux"), mode="generate", extra=extra) as srv:
        yield srv.url


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, smollm2):
    from vllm_helpers import make_tiny_data

    return make_tiny_data(tmp_path_factory.mktemp("sgl_live_data"), str(smollm2), n=6, max_length=160)


@pytest.fixture(scope="module")
def hf_store(smollm2, data_dir, tmp_path_factory):
    from eaglenest.cli import main

    out = tmp_path_factory.mktemp("sgl_live_hf") / "f"
    assert main(["capture", "--model", str(smollm2), "--data", str(data_dir), "--out", str(out), "--engine", "hf",
                 "--dtype", "fp32", "--device", "cpu"]) == 0
    return out


@pytest.fixture(scope="module")
def hf_store5(smollm2, data_dir, tmp_path_factory):
    from eaglenest.cli import main

    out = tmp_path_factory.mktemp("sgl_live_hf5") / "f"
    assert main(["capture", "--model", str(smollm2), "--data", str(data_dir), "--out", str(out), "--engine", "hf",
                 "--dtype", "fp32", "--device", "cpu", "--layers", ",".join(map(str, FIVE))]) == 0
    return out


def _generate(url, ids, rid, n=N_NEW):
    import httpx

    r = httpx.post(url + "/generate", json={"input_ids": [ids], "rid": [rid], "return_prompt_token_ids": True,
                                            "sampling_params": {"max_new_tokens": n, "temperature": 0.0}}, timeout=600)
    r.raise_for_status()
    item = r.json()[0]
    assert item["prompt_token_ids"] == ids and item["meta_info"]["prompt_tokens"] == len(ids)
    return item["output_ids"], item["meta_info"]["cached_tokens"]


@pytest.mark.parametrize("which", ["radix_on", "radix_off"])
def test_greedy_equals_hf_and_repeats_are_identical(smollm2, main_server, aux_server, which):
    url = main_server if which == "radix_on" else aux_server
    prompts = chat_ids(smollm2, QUESTIONS)
    want = hf_greedy(smollm2, prompts, N_NEW)
    cached = []
    for i, ids in enumerate(prompts):
        outs = []
        for k in range(3):
            out, c = _generate(url, ids, f"greedy-{which}-{i}-{k}")
            outs.append(out)
            cached.append(c)
        assert outs[0] == outs[1] == outs[2], (i, outs)
        assert outs[0] == want[i], (i, outs[0], want[i])
    if which == "radix_on":
        assert max(cached) > 0  # the repeats did reuse the cache: the radix path was exercised
    else:
        assert max(cached) == 0


def _stores_agree(a, b, min_cos=0.9999):
    from eaglenest.features import FeatureStore

    fa, fb = FeatureStore(a), FeatureStore(b)
    assert fa.meta.layer_ids == fb.meta.layer_ids and fa.meta.final_norm == fb.meta.final_norm == "post"
    other = {fb[i]["id"]: fb[i] for i in range(len(fb))}
    assert sorted(other) == sorted(fa.ids())
    H = fa.meta.hidden_size
    worst = []
    for i in range(len(fa)):
        x, y = fa[i], other[fa[i]["id"]]
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
        for k in range(len(fa.meta.layer_ids)):
            sl = slice(k * H, (k + 1) * H)
            worst.append(float(torch.nn.functional.cosine_similarity(
                x["aux_hidden_states"][:, sl].float(), y["aux_hidden_states"][:, sl].float(), dim=-1).min()))
        worst.append(float(torch.nn.functional.cosine_similarity(
            x["last_hidden_state"].float(), y["last_hidden_state"].float(), dim=-1).min()))
    assert min(worst) >= min_cos, worst
    return min(worst)


def test_plugin_capture_equals_the_hf_engine(smollm2, data_dir, hf_store, main_server, staging, tmp_path):
    from eaglenest.cli import main

    out = tmp_path / "sgl"
    with FlakyProxy(main_server) as rec:  # no faults: records what the client sends
        rc = main(["capture", "--model", str(smollm2), "--data", str(data_dir), "--out", str(out), "--engine", "sglang",
                   "--sglang-url", rec.url, "--sglang-staging", str(staging), "--sglang-batch", "3", "--dtype", "fp32"])
        bodies = [b for b in rec.bodies if "input_ids" in b]
    assert rc == 0
    _stores_agree(out, hf_store)
    assert bodies and not any("prompt_token_ids" in b for b in bodies)
    assert all(b["return_prompt_token_ids"] is True and b["extra_key"] == b["rid"] for b in bodies)
    assert sorted(p.name for p in staging.iterdir()) == ["eaglenest-plugin.json"]  # every dump collected and removed


def test_stock_mode_equals_the_hf_engine(smollm2, data_dir, hf_store5, main_server, aux_server, tmp_path, capsys):
    """Final state from a stock server, the aux concat from a server capturing ids [1, 8, 14, 20, 27]
    with SGLang's own rule: five layers, equal to HF hidden_states [2, 9, 15, 21, 28] -- the Llama +1
    rule, live; a run that wants other layers is refused by the preflight (it reads the aux server's
    ids from /server_info), before any sample is sent."""
    from eaglenest.cli import main
    from eaglenest.export.layer_ids import sglang_captures

    assert sglang_captures("LlamaForCausalLM", AUX_IDS, 30) == FIVE  # the one rule table, checked live here
    out = tmp_path / "stock"
    argv = ["capture", "--model", str(smollm2), "--data", str(data_dir), "--engine", "sglang", "--sglang-mode", "stock",
            "--sglang-url", main_server, "--sglang-aux-url", aux_server, "--dtype", "fp32"]
    assert main([*argv, "--out", str(out), "--layers", ",".join(map(str, FIVE))]) == 0
    assert _stores_agree(out, hf_store5) >= 0.9999
    capsys.readouterr()
    assert main([*argv, "--out", str(tmp_path / "three")]) == 2  # the canonical three: not what the aux server captures
    assert f"captures before layers {FIVE} (ids {AUX_IDS}), this run wants [2, 15, 27]" in capsys.readouterr().err


def test_regenerate_equals_the_hf_engine(smollm2, data_dir, main_server, tmp_path):
    from eaglenest.cli import main

    rows = {}
    for engine, extra in (("sglang", ["--sglang-url", main_server]), ("hf", ["--device", "cpu"])):
        out = tmp_path / engine
        assert main(["regenerate", "--model", str(smollm2), "--data", str(data_dir), "--out", str(out), "--engine", engine,
                     "--temperature", "0", "--max-new-tokens", "16", "--limit", "2", "--dtype", "fp32", *extra]) == 0
        rows[engine] = {r["id"]: r for r in map(json.loads, (out / "regenerate.jsonl").read_text().splitlines())}
    assert sorted(rows["sglang"]) == sorted(rows["hf"]) and len(rows["hf"]) == 2
    for sid, r in rows["hf"].items():
        assert rows["sglang"][sid]["input_ids"] == r["input_ids"] and rows["sglang"][sid]["loss_mask"] == r["loss_mask"]


def test_faults_between_client_and_server(smollm2, data_dir, hf_store, main_server, staging, tmp_path):
    """503s, a reset, a hung request and a proxy restart are retried and end stored; a corrupted
    echo and a sample that keeps failing are recorded with their reasons -- checked against the
    client's own account of its attempts, attempt by attempt against what the proxy did, never by
    counting requests in a time window; the rerun completes."""
    from eaglenest.capture.run import run_capture
    from eaglenest.data import PreparedData
    from eaglenest.engines.sglang.engine import SGLangEngine

    data = PreparedData(data_dir)
    ids = [data[i].id for i in range(len(data))]
    key = {data[i].id: tuple(data[i].input_ids) for i in range(len(data))}
    transient = {ids[0]: ("503", 2), ids[1]: ("reset", 1), ids[2]: ("timeout", 1)}
    persistent = {ids[3]: ("echo", None), ids[4]: ("503", None)}
    out = tmp_path / "faulty"
    with FlakyProxy(main_server, {key[s]: f for s, f in {**transient, **persistent}.items()}, hold=60.0) as proxy:
        with SGLangEngine(smollm2, urls=[proxy.url], staging=staging, batch=1, concurrency=2, retries=4, timeout=20.0,
                          backoff=0.05) as e:
            s = run_capture(e, data, out, dtype="fp32")
            stats = e.request_stats()
        seen = {sid: proxy.seen(key[sid]) for sid in ids}
    by_tag = {r["tag"]: r for r in stats["records"]}
    assert s.stored == 4 and s.failed == 2
    for sid in ids:  # every attempt the client logged reached the proxy, and what happened to it matches
        check_client_account(by_tag.get(sid), seen[sid])
    for sid, (kind, n) in transient.items():  # each fault injected exactly as often as asked, then stored
        assert seen[sid].count(kind) == n and by_tag[sid]["outcome"] == "ok", (seen[sid], by_tag[sid])
    assert seen[ids[4]] == ["503"] * 5 and by_tag[ids[4]]["outcome"] == "http_5xx"
    fails = {f["id"]: f for f in map(json.loads, (out / "failures.jsonl").read_text().splitlines())}
    assert {k: v["reason"] for k, v in fails.items()} == {ids[3]: "token_mismatch", ids[4]: "http_5xx"}
    assert "after 5 attempts" in fails[ids[4]]["message"]

    # the rerun, through a proxy that restarts (connections refused for a while) on the first
    # failed sample's first request: it is retried, and the store ends complete
    with FlakyProxy(main_server, {key[ids[3]]: ("restart", 1)}, down=1.0) as proxy:
        with SGLangEngine(smollm2, urls=[proxy.url], staging=staging, batch=1, concurrency=1, retries=6, timeout=60.0,
                          backoff=0.2) as e:
            s = run_capture(e, data, out, dtype="fp32")
            rec = {r["tag"]: r for r in e.request_stats()["records"]}
        seen3 = proxy.seen(key[ids[3]])
    assert s.stored == 2 and s.failed == 0
    assert seen3[0] == "restart" and rec[ids[3]]["outcome"] == "ok" and "connection" in rec[ids[3]]["failed_attempts"]
    _stores_agree(out, hf_store)


def test_online_training_from_sglang_equals_training_on_the_hf_store(smollm2, data_dir, hf_store, main_server, staging, tmp_path):
    """`train --online --engine sglang`: the server's states (plugin, /generate) go straight into the
    trainer; the run takes the same steps as training on the hf engine's store, with losses equal up
    to the engines' fp32 differences (their features agree to cosine >= 0.9999 per token, above)."""
    from eaglenest.cli import main

    common = ["--model", str(smollm2), "--ttt-steps", "2", "--draft-vocab", "1024", "--batch-tokens", "256", "--max-steps", "3",
              "--eval-fraction", "0", "--device", "cpu", "--dtype", "fp32"]
    assert main(["train", "--features", str(hf_store), "--out", str(tmp_path / "offline"), *common]) == 0
    assert main(["train", "--online", "--data", str(data_dir), "--engine", "sglang", "--sglang-url", main_server,
                 "--sglang-staging", str(staging), "--capture-dtype", "fp32", "--out", str(tmp_path / "online"), *common]) == 0
    off, on = ([json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()] for d in ("offline", "online"))
    assert [r["tokens"] for r in on] == [r["tokens"] for r in off] and len(on) == 3
    assert [r["loss"] for r in on] == pytest.approx([r["loss"] for r in off], rel=1e-4)  # measured: 1.2e-7 relative at most
    assert json.loads((tmp_path / "online" / "final.json").read_text())["online"]["failures"] == {"total": 0}


def _in_sglang_env(code: str) -> subprocess.CompletedProcess:
    """Run `code` in .venv-sglang, prepared as eaglenest's launcher prepares a server process."""
    from eaglenest.engines.sglang.server import cpu_server_pythonpath

    import os

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, cpu_server_pythonpath())))
    return subprocess.run([str(sglang_python()), "-c", code], capture_output=True, text=True, env=env, timeout=600,
                          cwd=REPO)


def test_tp_rank_is_read_from_sglangs_runtime_context():
    """The plugin's rank read against the real module of the installed 0.5.23 (not an injected
    function): an unpublished rank is an error, rank 1 does not write, rank 0 plans a capture."""
    code = r"""
from eaglenest.engines.sglang import launcher as sglang_launch
sglang_launch.prepare_process()
from types import SimpleNamespace
from eaglenest.engines.sglang import plugin
from sglang.srt.runtime_context import get_parallel
try:
    plugin._tp_rank(); unpublished = "read"
except Exception as e:
    unpublished = type(e).__name__
model = SimpleNamespace(config=SimpleNamespace(num_hidden_layers=6), layers=[])
fb = SimpleNamespace(forward_mode=SimpleNamespace(name="EXTEND"), rids=["eaglenest-cap-x"], extend_seq_lens_cpu=[3],
                     extend_prefix_lens_cpu=[0], can_run_tbo=False)
obs = plugin.Observer("/tmp/eaglenest-rank-test", layer_ids=[1, 2, 3], writer=plugin.DumpWriter("/tmp/eaglenest-rank-test", threaded=False))
out = {"unpublished": unpublished, "unpublished_plan": obs.plan(plugin.LLAMA, model, (None, None, fb), {}).error[0]}
for r in (1, 0):
    get_parallel().override_permanently(tp_rank=r)
    p = obs.plan(plugin.LLAMA, model, (None, None, fb), {})
    out[r] = [plugin._tp_rank(), None if p is None else p.rids]
import json; print(json.dumps(out))
"""
    r = _in_sglang_env(code)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["unpublished"] in ("RuntimeError", "ValueError") and out["unpublished_plan"] == "tp_rank_unknown"
    assert out["1"] == [1, None] and out["0"] == [0, ["eaglenest-cap-x"]]


def test_amx_gate_is_forced_off_even_where_the_cpu_reports_amx():
    """On this CPU (no AMX) the probe is made to say True, as on an Intel AMX machine: SGLang's own
    gate then reads True without the launcher, and False with it."""
    code = r"""
import json, sys, torch
torch.cpu._is_amx_tile_supported = lambda: True  # an AMX machine, as far as SGLang can tell
if sys.argv[1] == "launcher":
    from eaglenest.engines.sglang import launcher as sglang_launch
    reported = sglang_launch.force_torch_native()
    sglang_launch.declare_torchvision_schemas()
else:
    from eaglenest.engines.sglang import launcher as sglang_launch
    sglang_launch.declare_torchvision_schemas()  # only what importing SGLang needs
    reported = None
from sglang.srt.utils import common
from sglang.srt.runtime_context import get_platform
print(json.dumps({"reported": reported, "probe": common.is_amx_tile_supported, "has_amx": get_platform().has_amx}))
"""
    got = {}
    for how in ("launcher", "bare"):
        r = _in_sglang_env(code.replace("sys.argv[1]", repr(how)))
        assert r.returncode == 0, r.stderr[-2000:]
        got[how] = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["bare"]["probe"] is True  # the fake AMX reaches SGLang's gate without the launcher...
    assert got["launcher"] == {"reported": True, "probe": False, "has_amx": False}  # ...and not with it
    assert got["bare"]["has_amx"] is False  # (the compat sgl_kernel registers no ops: the second half of the gate)


def test_plugin_check_on_the_cpu_environment(capsys):
    from eaglenest.cli import main

    assert main(["sglang-plugin", "check", "--python", str(sglang_python()), "--cpu"]) == 0
    out = capsys.readouterr().out
    assert "SGLang 0.5.23" in out and "import sglang: ok" in out and "FAIL" not in out
    assert "tensor-parallel rank: read from sglang.srt.runtime_context.get_parallel().tp_rank" in out
