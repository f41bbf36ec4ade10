"""The vLLM engine's protocol handling and `regenerate`'s turn logic, without vLLM.

A fake server on 127.0.0.1 speaks the parts of vLLM's /v1/completions the engine uses; a fake
engine drives `regenerate`.  The live tests are in test_vllm_live_*.py.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eaglenest.engines.base import Captured, Engine, Failure, Generated, Request
from eaglenest.engines.vllm import VLLMEngine, finish_generated, parse_prometheus, read_hidden_states
from helpers_eval import eval_args
from vllm_helpers import REPO, FakeVLLM, completion

H = 64  # tiny_llama_dir: hidden 64 (explicit aux ids 1,3,4; the final id is its layer count)


def _engine(tiny_llama_dir, url, **kw) -> VLLMEngine:
    return VLLMEngine(str(tiny_llama_dir), layers="1,3,4", urls=[url], retries=kw.pop("retries", 0), timeout=10, **kw)


def _write_states(path: Path, ids: list[int], L: int = 4, lock: bool = True, delay: float = 0.0, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(len(ids), L, H, generator=g).to(torch.bfloat16)
    if not lock:
        save_file({"hidden_states": hs, "token_ids": torch.tensor(ids)}, str(path))
        return hs
    fd = os.open(str(path) + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)

    def write():
        time.sleep(delay)
        save_file({"hidden_states": hs, "token_ids": torch.tensor(ids)}, str(path))
        os.close(fd)  # releases the lock, like the connector's writer thread

    threading.Thread(target=write).start()
    return hs


def test_capture_reads_and_splits_staged_states(tiny_llama_dir, tmp_path):
    written = {}

    def handler(p):
        path = tmp_path / f"{len(written)}.safetensors"
        written[str(path)] = _write_states(path, p["prompt"], delay=0.2)
        assert p["max_tokens"] == 1 and p["return_token_ids"] is True
        return 200, completion(p["prompt"], hidden_states_path=path)

    with FakeVLLM(handler) as srv:
        e = _engine(tiny_llama_dir, srv.url)
        try:
            assert e.info().final_norm == "pre" and e.info().layer_ids == [1, 3, 4]
            (res,) = e.capture([Request("a", [5, 6, 7])])
        finally:
            e.close()
    assert isinstance(res, Captured), res
    (path, hs), = written.items()
    assert res.input_ids.tolist() == [5, 6, 7]
    assert res.aux_hidden_states.shape == (3, 3 * H) and res.last_hidden_state.shape == (3, H)
    assert torch.equal(res.aux_hidden_states, torch.cat([hs[:, 0], hs[:, 1], hs[:, 2]], dim=-1))
    assert torch.equal(res.last_hidden_state, hs[:, 3])
    assert not os.path.exists(path) and not os.path.exists(path + ".lock"), "staging files must be removed"


def test_token_mismatch_fails_the_sample(tiny_llama_dir, tmp_path):
    def handler(p):
        path = tmp_path / "x.safetensors"
        _write_states(path, p["prompt"], lock=False)
        wrong = [1] + p["prompt"]  # e.g. a BOS the server added
        return 200, completion(wrong, hidden_states_path=path)

    with FakeVLLM(handler) as srv:
        e = _engine(tiny_llama_dir, srv.url)
        try:
            (res,) = e.capture([Request("s1", [5, 6, 7])])
        finally:
            e.close()
    assert isinstance(res, Failure) and res.reason == "token_mismatch"
    assert "sent [5, 6, 7]" in res.message and "seen [1, 5, 6" in res.message
    assert not (tmp_path / "x.safetensors").exists()


def test_mismatch_inside_the_staging_file_is_caught(tiny_llama_dir, tmp_path):
    def handler(p):
        path = tmp_path / "y.safetensors"
        _write_states(path, [9] + p["prompt"][1:], lock=False)
        return 200, completion(p["prompt"], hidden_states_path=path)

    with FakeVLLM(handler) as srv:
        e = _engine(tiny_llama_dir, srv.url)
        try:
            (res,) = e.capture([Request("s1", [5, 6, 7])])
        finally:
            e.close()
    assert isinstance(res, Failure) and res.reason == "token_mismatch" and "hidden-state file" in res.message


def test_wrong_layer_count_and_missing_path(tiny_llama_dir, tmp_path):
    def handler(p):
        if p["prompt"][0] == 5:
            path = tmp_path / "z.safetensors"
            _write_states(path, p["prompt"], L=3, lock=False)
            return 200, completion(p["prompt"], hidden_states_path=path)
        return 200, completion(p["prompt"])  # a server without the extractor

    with FakeVLLM(handler) as srv:
        e = _engine(tiny_llama_dir, srv.url)
        try:
            a, b = e.capture([Request("a", [5, 6]), Request("b", [8, 9])])
        finally:
            e.close()
    assert isinstance(a, Failure) and a.reason == "bad_shape" and f"layer ids [1, 3, 4, {e.num_layers}]" in a.message
    assert isinstance(b, Failure) and b.reason == "no_hidden_states"


def test_retries_5xx_then_succeeds_and_gives_up_with_reason(tiny_llama_dir, tmp_path):
    calls = {"n": 0}

    def handler(p):
        calls["n"] += 1
        if p["prompt"][0] == 7 or calls["n"] == 1:
            return 503, {"error": "overloaded"}
        path = tmp_path / f"{calls['n']}.safetensors"
        _write_states(path, p["prompt"], lock=False)
        return 200, completion(p["prompt"], hidden_states_path=path)

    with FakeVLLM(handler) as srv:
        e = _engine(tiny_llama_dir, srv.url, retries=2, concurrency=1)
        try:
            ok, bad = e.capture([Request("ok", [5, 6]), Request("bad", [7, 8])])
        finally:
            e.close()
    assert isinstance(ok, Captured)
    assert isinstance(bad, Failure) and bad.reason == "http_5xx" and "after 3 attempts" in bad.message


def test_connection_refused_is_a_failure(tiny_llama_dir):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    e = _engine(tiny_llama_dir, f"http://127.0.0.1:{port}", retries=1)
    try:
        (res,) = e.capture([Request("a", [5, 6])])
    finally:
        e.close()
    assert isinstance(res, Failure) and res.reason == "connection"


def test_out_of_vocab_never_reaches_the_server(tiny_llama_dir):
    with FakeVLLM(lambda p: (500, {})) as srv:
        e = _engine(tiny_llama_dir, srv.url)
        try:
            (res,) = e.capture([Request("a", [5, 10**6])])
        finally:
            e.close()
        assert res.reason == "token_out_of_vocab" and not srv.requests


def test_capture_cli_with_fake_url_records_token_mismatch(tiny_llama_dir, tmp_path):
    """End to end through `eaglenest capture --engine vllm --vllm-url`: the sample fails, is
    written to failures.jsonl with its reason, and the run exits 1."""
    from eaglenest.cli import main
    from eaglenest.data import Sample, write_prepared

    data = tmp_path / "data"
    write_prepared(data, [Sample("good", [1, 2, 3, 4], [0, 0, 1, 1]), Sample("bad", [1, 2, 9, 9, 9], [0, 0, 1, 1, 1])],
                   {"target": str(tiny_llama_dir)}, vocab_size=49152)

    def handler(p):
        path = tmp_path / f"{p['prompt'][-1]}-{len(p['prompt'])}.safetensors"
        _write_states(path, p["prompt"], lock=False)
        echo = p["prompt"] if p["prompt"][2] != 9 else p["prompt"][:-1]  # drops a token
        return 200, completion(echo, hidden_states_path=path)

    with FakeVLLM(handler) as srv:
        rc = main(["capture", "--model", str(tiny_llama_dir), "--data", str(data), "--out", str(tmp_path / "feat"),
                   "--engine", "vllm", "--vllm-url", srv.url, "--layers", "1,3,4", "--vllm-retries", "0"])
    assert rc == 1
    import json

    fails = [json.loads(x) for x in (tmp_path / "feat" / "failures.jsonl").read_text().splitlines()]
    assert [(f["id"], f["reason"]) for f in fails] == [("bad", "token_mismatch")]
    from eaglenest.features import FeatureStore

    fs = FeatureStore(tmp_path / "feat")
    assert fs.ids() == ["good"] and fs.meta.final_norm == "pre" and fs.meta.engine == "vllm"


def test_read_hidden_states_waits_for_the_writer(tmp_path):
    path = tmp_path / "w.safetensors"
    hs = _write_states(path, [1, 2], delay=0.3)
    t = time.time()
    d = read_hidden_states(str(path), timeout=10)
    assert time.time() - t >= 0.25 and torch.equal(d["hidden_states"], hs)


def test_generate_ends_turns_with_the_stop_token(tiny_llama_dir):
    def handler(p):
        assert p["skip_special_tokens"] is False and p["return_token_ids"] is True and 2 in p["stop_token_ids"]
        if p["prompt"][0] == 1:
            return 200, completion(p["prompt"], token_ids=[10, 11], finish="stop", stop_reason=None)  # eos not echoed
        if p["prompt"][0] == 3:
            return 200, completion(p["prompt"], token_ids=[10, 11, 2], finish="stop")
        return 200, completion(p["prompt"], token_ids=[10] * p["max_tokens"], finish="length")

    with FakeVLLM(handler) as srv:
        e = _engine(tiny_llama_dir, srv.url)
        try:
            a, b, c = e.generate([Request("a", [1, 5]), Request("b", [3, 5]), Request("c", [4, 5])], 4)
        finally:
            e.close()
    assert (a.output_ids, a.finish_reason) == ([10, 11, 2], "stop")
    assert (b.output_ids, b.finish_reason) == ([10, 11, 2], "stop")
    assert (c.output_ids, c.finish_reason) == ([10] * 4, "length")
    assert finish_generated("x", [1], [7, 99], "stop", 99, [2]).output_ids == [7, 99]


def test_parse_prometheus_and_spec_counters():
    from eaglenest.evaluate.engine_vllm import spec_counters

    text = """# HELP x
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 5.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 2.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 0.0
"""
    m = parse_prometheus(text)
    c = spec_counters(m, 3)
    assert c["drafts"] == 10 and c["accepted"] == 7 and c["per_pos"] == [5, 2, 0]


def test_connector_module_is_light():
    """vLLM workers import the connector by module path: it must not drag torch/transformers in."""
    code = ("import sys, eaglenest.engines.vllm_connector as m; "
            "bad = [x for x in ('torch', 'transformers', 'vllm') if x in sys.modules]; "
            "assert not bad, bad; assert m.CONNECTOR_NAME == 'CPUHiddenStatesConnector'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# ------------------------------------------------------------------------------ regenerate logic


class FakeEngine(Engine):
    """Answers each prompt with `answers[(len(prompt))]` or a default; records prompts."""

    name = "fake"

    def __init__(self, reply):
        self.reply = reply
        self.prompts: list[list[int]] = []

    def info(self):
        raise NotImplementedError

    def capture(self, batch):
        raise NotImplementedError

    def generate(self, batch, max_new_tokens, temperature=0.0, seed=0):
        out = []
        for r in batch:
            self.prompts.append(list(r.input_ids))
            res = self.reply(r, max_new_tokens)
            out.append(res)
        return out


def test_turn_spans():
    from eaglenest.data.regenerate import turn_spans

    assert turn_spans([0, 1, 1, 0, 0, 1, 0, 1]) == [(1, 3), (5, 6), (7, 8)]
    assert turn_spans([0, 0]) == [] and turn_spans([1, 1]) == [(0, 2)]


def _sample(sid, ids, mask):
    from eaglenest.data import Sample

    return Sample(sid, ids, mask)


def test_regenerate_two_turns_sequentially():
    from eaglenest.data.regenerate import regenerate_samples

    EOT, NL = 2, 198
    # [sys/user/header] A A EOT \n [user2 header] B EOT \n
    ids = [1, 50, 51, 60, 61, EOT, NL, 1, 52, 53, 70, EOT, NL]
    mask = [0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 1, 1, 0]
    eng = FakeEngine(lambda r, n: Generated(r.id, r.input_ids, [90 + len(r.input_ids), EOT], "stop"))
    (row,) = regenerate_samples(eng, [_sample("s", ids, mask)], max_new_tokens=8, temperature=0.0, seed=0,
                                max_length=None, eot_ids={EOT})
    assert eng.prompts[0] == [1, 50, 51]
    turn1 = [93, EOT]
    assert eng.prompts[1] == [1, 50, 51, *turn1, NL, 1, 52, 53]  # conditioned on its own first answer
    turn2 = [90 + len(eng.prompts[1]), EOT]
    assert row["input_ids"] == [1, 50, 51, *turn1, NL, 1, 52, 53, *turn2, NL]
    assert row["loss_mask"] == [0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 0]
    assert row["turns"] == 2 and not row["truncated"] and row["generated_tokens"] == 4


def test_regenerate_mask_without_eot_and_length_stop_drops_later_turns():
    from eaglenest.data.regenerate import regenerate_samples

    EOT = 2
    # data whose mask excludes the end-of-turn token: the gap starts with it
    ids = [1, 50, 60, EOT, 1, 52, 70, EOT]
    mask = [0, 0, 1, 0, 0, 0, 1, 0]
    eng = FakeEngine(lambda r, n: Generated(r.id, r.input_ids, [80, EOT], "stop"))
    (row,) = regenerate_samples(eng, [_sample("s", ids, mask)], max_new_tokens=8, temperature=0.0, seed=0,
                                max_length=None, eot_ids={EOT})
    assert row["input_ids"] == [1, 50, 80, EOT, 1, 52, 80, EOT]  # no doubled EOT
    assert row["loss_mask"] == [0, 0, 1, 1, 0, 0, 1, 1]

    eng = FakeEngine(lambda r, n: Generated(r.id, r.input_ids, [80] * n, "length"))
    (row,) = regenerate_samples(eng, [_sample("s", ids, mask)], max_new_tokens=3, temperature=0.0, seed=0,
                                max_length=None, eot_ids={EOT})
    assert row["input_ids"] == [1, 50, 80, 80, 80] and row["loss_mask"] == [0, 0, 1, 1, 1]
    assert row["truncated"] and row["turns"] == 1 and row["turns_in_source"] == 2 and len(eng.prompts) == 1


def test_regenerate_failures_and_max_turns():
    from eaglenest.data.regenerate import regenerate_samples

    EOT = 2
    good = _sample("g", [1, 50, 60, EOT, 9, 70, EOT], [0, 0, 1, 1, 0, 1, 1])
    nomask = _sample("n", [1, 2, 3], [0, 0, 0])
    echo_bad = _sample("e", [7, 50, 60, EOT], [0, 0, 1, 1])

    def reply(r, n):
        if r.input_ids[0] == 7:
            return Generated(r.id, r.input_ids[1:], [5, EOT], "stop")  # server dropped a token
        return Generated(r.id, r.input_ids, [5, EOT], "stop")

    rows = regenerate_samples(FakeEngine(reply), [good, nomask, echo_bad], max_new_tokens=4, temperature=0.0,
                              seed=0, max_length=None, eot_ids={EOT}, max_turns=1)
    assert rows[0]["input_ids"] == [1, 50, 5, EOT] and rows[0]["turns"] == 1 and rows[0]["turns_in_source"] == 2
    assert isinstance(rows[1], Failure) and rows[1].reason == "no_assistant_turn"
    assert isinstance(rows[2], Failure) and rows[2].reason == "token_mismatch"


def test_run_regenerate_is_resumable(tiny_llama_dir, tmp_path):
    from eaglenest.data import PreparedData, Sample, write_prepared
    from eaglenest.data.regenerate import run_regenerate

    EOT = 2
    src = tmp_path / "src"
    write_prepared(src, [Sample(f"s{i}", [1, 40 + i, 60, EOT], [0, 0, 1, 1]) for i in range(5)],
                   {"target": str(tiny_llama_dir), "max_length": 64}, vocab_size=49152)
    calls = []

    def reply(r, n):
        calls.append(r.id)
        if r.id == "s3" and calls.count("s3") == 1:
            return Failure(r.id, "timeout", "slow")
        return Generated(r.id, r.input_ids, [300 + r.input_ids[1], EOT], "stop")

    out = tmp_path / "out"
    s = run_regenerate(FakeEngine(reply), PreparedData(src), out, model_path=tiny_llama_dir, temperature=0.0,
                       max_new_tokens=8, batch_size=2)
    assert s.failed == 1 and s.done == 4
    d = PreparedData(out)
    assert len(d) == 4 and "s3" not in d.ids()
    s2 = run_regenerate(FakeEngine(reply), PreparedData(src), out, model_path=tiny_llama_dir, temperature=0.0,
                        max_new_tokens=8, batch_size=2)
    assert s2.done == 1 and s2.skipped_done == 4 and s2.failed == 0
    d = PreparedData(out)
    assert d.ids() == [f"s{i}" for i in range(5)]  # source order
    assert d[3].input_ids == [1, 43, 343, EOT] and d[3].loss_mask == [0, 0, 1, 1]
    assert d.meta["notes"]["regenerated"]["samples"] == 5
    with pytest.raises(Exception, match="other settings"):
        run_regenerate(FakeEngine(reply), PreparedData(src), out, model_path=tiny_llama_dir, temperature=0.5,
                       max_new_tokens=8)


def test_repeated_share_and_loops():
    from eaglenest.data.regenerate import loops, repeated_share

    assert repeated_share([1, 2, 3, 4], 2) == 0.0 and repeated_share([5], 8) == 0.0
    assert repeated_share([1, 2, 1, 2, 1, 2], 2) == pytest.approx(3 / 5)  # (1,2) (2,1) new, then 3 repeats of 5
    cycle = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    row = {"input_ids": [1, 2] + cycle * 3 + [3], "loss_mask": [0, 0] + [1] * 30 + [0]}
    assert repeated_share(cycle * 3, 8) == pytest.approx(13 / 23) and loops(row, 8, 0.2)  # the grams from the 2nd cycle on
    assert not loops({"input_ids": [1, 2] + list(range(40, 70)), "loss_mask": [0, 0] + [1] * 30}, 8, 0.2)
    # a later turn that loops makes the sample loop; the prompt's own repeats do not count
    two = {"input_ids": cycle * 3 + [5, 6, 7] + [8] * 12, "loss_mask": [0] * 30 + [1] * 3 + [1] * 12}
    assert loops(two, 8, 0.2) and not loops({**two, "input_ids": cycle * 3 + list(range(100, 115))}, 8, 0.2)


def test_run_regenerate_counts_and_drops_loops_and_capped_answers(tiny_llama_dir, tmp_path, capsys):
    """Looping answers (repeated 8-grams) and answers cut at the length cap are counted in the output
    and the meta, and left out with --drop-loops / --drop-capped; a re-run with other flags rewrites
    the DATA_DIR from the log (nothing generated again); samples sharing a normalized prompt are counted."""
    from eaglenest.data import PreparedData, Sample, write_prepared
    from eaglenest.data.regenerate import Quality, run_regenerate

    EOT = 2
    src = tmp_path / "src"
    # s0 s1: fine answers; s2: a loop; s3: cut at the cap (12 new tokens); s4: s0's prompt again
    write_prepared(src, [Sample(f"s{i}", [1, 40 + (i % 4), 60, EOT], [0, 0, 1, 1]) for i in range(5)],
                   {"target": str(tiny_llama_dir), "max_length": 64}, vocab_size=49152)
    calls = []

    def reply(r, n):
        calls.append(r.id)
        p = r.input_ids[1]
        if p == 42:
            return Generated(r.id, r.input_ids, [70, 71, 72, 73, 74] * 4 + [EOT], "stop")  # 8 of 14 8-grams repeat
        if p == 43:
            return Generated(r.id, r.input_ids, list(range(200, 200 + n)), "length")
        return Generated(r.id, r.input_ids, list(range(300 + 20 * (p - 40), 310 + 20 * (p - 40))) + [EOT], "stop")

    out = tmp_path / "out"
    kw = dict(model_path=tiny_llama_dir, temperature=0.0, max_new_tokens=12, batch_size=2)
    s = run_regenerate(FakeEngine(reply), PreparedData(src), out, **kw)
    assert (s.done, s.looping, s.truncated, s.dropped, s.duplicate_prompts) == (5, 1, 1, 0, 1)
    judged = PreparedData(out).meta["notes"]["regenerated"]["judged"]
    assert judged["looping"] == 1 and judged["length_capped"] == 1 and judged["dropped"] == 0
    assert judged["loop_rule"] == {"ngram": 8, "min_repeated_share": 0.2} and judged["duplicate_prompts"] == 1
    assert "of 5 answers, 1 loop" in capsys.readouterr().err and len(PreparedData(out)) == 5

    n_calls = len(calls)
    s = run_regenerate(FakeEngine(reply), PreparedData(src), out, quality=Quality(drop_loops=True, drop_capped=True), **kw)
    assert len(calls) == n_calls and s.skipped_done == 5  # rewritten from the log
    d = PreparedData(out)
    assert d.ids() == ["s0", "s1", "s4"] and (s.looping, s.truncated, s.dropped) == (1, 1, 2)
    judged = d.meta["notes"]["regenerated"]["judged"]
    assert (judged["dropped_looping"], judged["dropped_length_capped"], judged["drop_loops"]) == (1, 1, True)
    err = capsys.readouterr().err
    assert "2 left out (--drop-loops: 1, --drop-capped: 1)" in err
    # a stricter rule flags nothing here; a looser one flags more
    s = run_regenerate(FakeEngine(reply), PreparedData(src), out, quality=Quality(loop_ngram=4, loop_share=0.9), **kw)
    assert s.looping == 0
    from eaglenest import EaglenestError

    with pytest.raises(EaglenestError, match="every one of the 5 answers was left out"):  # said, not an empty DATA_DIR
        run_regenerate(FakeEngine(lambda r, n: Generated(r.id, r.input_ids, [70, 71, 72, 73, 74] * 4 + [EOT], "stop")),
                       PreparedData(src), tmp_path / "all", quality=Quality(drop_loops=True), **kw)


def test_server_command_binds_loopback_and_disables_caching(tmp_path):
    from eaglenest.engines.vllm import server_command

    cmd = server_command("py", "/m", port=1234, capture=([2, 15, 27], 30, tmp_path))
    s = " ".join(cmd)
    assert "--host 127.0.0.1" in s and "0.0.0.0" not in s and "--enforce-eager" in s
    assert "--no-enable-chunked-prefill" in cmd and "--no-enable-prefix-caching" in cmd
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec["method"] == "extract_hidden_states"
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27, 30]
    kv = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert kv["kv_connector_module_path"] == "eaglenest.engines.vllm_connector"
    assert kv["kv_connector_extra_config"]["shared_storage_path"] == str(tmp_path)


def test_regenerate_stops_cleanly_when_max_length_leaves_no_room():
    from eaglenest.data.regenerate import regenerate_samples

    EOT = 2
    ids = [1, 50, 60, EOT, 9, 9, 9, 70, EOT]
    mask = [0, 0, 1, 1, 0, 0, 0, 1, 1]
    eng = FakeEngine(lambda r, n: Generated(r.id, r.input_ids, [80] * (n - 1) + [EOT], "stop"))
    (row,) = regenerate_samples(eng, [_sample("s", ids, mask)], max_new_tokens=4, temperature=0.0, seed=0,
                                max_length=7, eot_ids={EOT})
    # turn 1 fills the room (4 tokens: 2 + 4 = 6), the next user turn would not fit: it is not kept dangling
    assert row["input_ids"] == [1, 50, 80, 80, 80, EOT] and row["loss_mask"] == [0, 0, 1, 1, 1, 1]
    assert row["truncated"] and row["turns"] == 1 and len(eng.prompts) == 1


def test_server_baseline_divergence_records_the_baseline_near_tie():
    """A greedy mismatch against a server baseline carries the baseline's top logprobs at the first
    differing token (vLLM's `return_tokens_as_token_ids` keys) and its margin over the spec's token."""
    from eaglenest.evaluate.engine_vllm import top_logprobs
    from eaglenest.evaluate.run import merge_server_baseline

    choice = {"logprobs": {"top_logprobs": [{"token_id:5": -0.1, "token_id:9": -2.5},
                                            {"token_id:7": -0.70, "token_id:8": -0.75}, None]}}
    lps = top_logprobs(choice)
    assert lps == [{5: -0.1, 9: -2.5}, {7: -0.70, 8: -0.75}, {}]

    def rec(turn, prompt, out, **kw):
        return {"id": "q", "turn": turn, "prompt_ids": prompt, "output_ids": out, "generated_tokens": len(out), "wall_s": 1.0, **kw}

    spec = [rec(1, [1], [5, 8, 3]), rec(2, [1, 5, 8, 3], [4])]
    base = [rec(1, [1], [5, 7, 3], top_logprobs=lps), rec(2, [1, 5, 7, 3], [4], top_logprobs=[{4: -0.01}])]
    mm = merge_server_baseline(spec, base, greedy=True)
    assert [m["where"] for m in mm] == ["token 1", "prompt (an earlier turn already differed)"]
    assert mm[0]["position"] == 1 and mm[0]["spec"] == [8, 3] and mm[0]["baseline"] == [7, 3]
    assert mm[0]["baseline_top_logprobs"] == {"7": -0.70, "8": -0.75} and abs(mm[0]["logprob_gap"] - 0.05) < 1e-9
    assert [r["matches_baseline"] for r in spec] == [False, False]
    # the spec's token outside the baseline's top logprobs: no margin to show
    base[0]["top_logprobs"] = [{5: -0.1}, {7: -0.01}, {}]
    assert merge_server_baseline(spec, base, greedy=True)[0]["logprob_gap"] is None


def test_conversations_run_concurrently_in_order_and_totals_replace_per_record_counts(tiny_llama_dir):
    """`--engine-arg concurrency=N` (vLLM eval): N conversations in flight at once (two first turns
    meet at a barrier, which one-at-a-time decoding never reaches), each conversation's turns in
    order (turn 2's prompt holds turn 1's answer), records in prompt order; the run's counters
    (totals) replace the per-record ones in the report's tau and acceptance."""
    from types import SimpleNamespace

    from eaglenest.evaluate.run import run_conversations, summarize
    from eaglenest.models.target import load_tokenizer

    tok = load_tokenizer(str(tiny_llama_dir))
    prompts = [SimpleNamespace(id=f"q{i}", turns=[f"question {i}", f"follow-up {i}"]) for i in range(4)]
    meet = {"barrier": threading.Barrier(2, timeout=30)}
    answers = {}

    def answer(p, turn, ids):
        if turn == 1 and p.id in ("q0", "q1"):
            meet["barrier"].wait()  # raises BrokenBarrierError unless q0 and q1 are in flight together
        out = tok(f"answer {p.id} {turn}", add_special_tokens=False)["input_ids"]
        answers[(p.id, turn)] = ids
        return {"id": p.id, "turn": turn, "output_ids": out, "generated_tokens": len(out), "wall_s": 0.5}

    recs = run_conversations(prompts, 2, tok, set(), "test", answer, concurrency=2)
    assert [(r["id"], r["turn"]) for r in recs] == [(f"q{i}", t) for i in range(4) for t in (1, 2)]
    assert all(tok.decode(answers[(f"q{i}", 2)]).count(f"answer q{i} 1") == 1 for i in range(4))
    with pytest.raises(threading.BrokenBarrierError):  # one at a time: q1 never arrives while q0 waits
        meet["barrier"] = threading.Barrier(2, timeout=1)
        run_conversations(prompts[:2], 1, tok, set(), "test", answer, concurrency=1)
    out = summarize(recs, 3, {"verify_steps": 10, "verified_tokens": 17, "accepted_per_position": [5, 2, 0]})
    assert out["tau"] == 1.7 and out["accept_per_position"] == [0.5, 0.2, 0.0] and out["verify_steps"] == 10
    assert out["generated_tokens"] == sum(r["generated_tokens"] for r in recs)


def test_vllm_eval_refuses_a_bad_concurrency(tiny_llama_dir, tmp_path):
    from eaglenest import EaglenestError
    from eaglenest.evaluate.engine_vllm import run_eval

    for bad in ("0", "two"):
        a = eval_args(tiny_llama_dir, tmp_path, "mtbench", tmp_path / "r.json", "vllm", limit=1, steps=3, max_new_tokens=8,
                      device="cpu", dtype="bf16", no_baseline=True, engine_args={"concurrency": bad})
        with pytest.raises(EaglenestError, match="concurrency must be a whole number"):
            run_eval(a)
