"""Live: `--sglang-serve` -- eaglenest starts SGLang 0.5.23's CPU engine itself (127.0.0.1, a free
port, the log kept where --sglang-log says) and stops it when the command ends: capture through the
plugin on five non-canonical layers (a DFlash-sized set) at tensor parallelism 2 equals the hf
engine, written by rank 0 only;
`eval --engine sglang --sglang-serve` with our exported draft (--speculative-algorithm EAGLE3) stops
with the exact reason SGLang's CPU path cannot serve it."""

from __future__ import annotations

import re

import pytest

from sglang_live import requires_sglang

pytestmark = [pytest.mark.sglang, pytest.mark.slow, requires_sglang]

LAYERS = "3,9,15,21,26"  # five, none of them canonical


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, smollm2):
    from vllm_helpers import make_tiny_data

    return make_tiny_data(tmp_path_factory.mktemp("sgl_serve_data"), str(smollm2), n=4, max_length=160)


def test_capture_with_sglang_serve_at_tp_2(smollm2, data_dir, tmp_path, monkeypatch, capsys):
    """`capture --sglang-serve` on non-canonical layers, with the started server at tensor
    parallelism 2 (two scheduler processes on the CPU, one core each, gloo): the features equal the
    hf engine's, both ranks load the plugin, and every capture file the client reads was written by
    TP rank 0, always by the same process."""
    import httpx

    from eaglenest.cli import main
    from eaglenest.engines.sglang import plugin as sglang_plugin
    from test_sglang_live import _stores_agree

    hf = tmp_path / "hf"
    assert main(["capture", "--model", str(smollm2), "--data", str(data_dir), "--out", str(hf), "--engine", "hf",
                 "--dtype", "fp32", "--device", "cpu", "--layers", LAYERS]) == 0
    read = []
    real_read = sglang_plugin.read_dump

    def spy(path):  # watches what the client reads; the files themselves are the server's
        t, meta = real_read(path)
        read.append(meta)
        return t, meta

    monkeypatch.setattr(sglang_plugin, "read_dump", spy)
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", "0|1")  # SGLang's CPU TP: one core per rank
    log = tmp_path / "server.log"
    out = tmp_path / "sgl"
    capsys.readouterr()
    assert main(["capture", "--model", str(smollm2), "--data", str(data_dir), "--out", str(out), "--engine", "sglang",
                 "--sglang-serve", "--sglang-log", str(log), "--dtype", "fp32", "--layers", LAYERS,
                 "--sglang-arg=--tp-size=2", "--sglang-batch", "2"]) == 0
    _stores_agree(out, hf)
    text = log.read_text(errors="replace")
    observing = set(re.findall(r"observing sglang\.srt\.models\.llama\.LlamaModel\.forward \(pid (\d+), layers "
                               + re.escape(str([int(k) for k in LAYERS.split(",")])), text))
    assert len(observing) == 2, observing  # the plugin is active in both TP processes
    assert read and {m["tp_rank"] for m in read} == {"0"} and len({m["pid"] for m in read}) == 1
    assert {m["pid"] for m in read} <= observing
    assert "torch-native CPU path" in text  # eaglenest's launcher ran, and prepared the processes SGLang spawned
    prepared = set(re.findall(r"eaglenest sglang launcher: prepared spawned process (\d+)", text))
    assert observing <= prepared, (observing, prepared)
    # the port from eaglenest's own account of the server it started (SGLang's log wording is not ours)
    port = re.findall(r"sglang: starting server on http://127\.0\.0\.1:(\d+)", capsys.readouterr().err)[-1]
    with pytest.raises(httpx.TransportError):  # stopped at the end of the command
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)


def test_eval_serving_our_draft_needs_sglangs_cpu_kernels(smollm2, tmp_path, capsys):
    """SGLang 0.5.23's CPU path cannot serve an EAGLE-3 draft without its CPU kernels (not on PyPI):
    with --speculative-algorithm EAGLE3 the KV pool's copy warm-up calls
    sgl_kernel.copy_all_layer_kv_cache_cpu at start-up (mem_cache/memory_pool.py
    _init_kv_copy_and_warmup), and the tree build/verify would call build_tree_kernel_efficient_cpu /
    verify_tree_greedy_cpu.  The eval stops with that exact cause (docs/sglang.md); the tau
    arithmetic is covered against the protocol stand-in (tests/test_sglang_client.py)."""
    import json

    from eaglenest.cli import main
    from vllm_helpers import make_random_draft

    draft = make_random_draft(tmp_path / "draft", smollm2)
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"question_id": 1, "turns": ["What is the capital of France?"]}) + "\n")
    rc = main(["eval", "--model", str(smollm2), "--draft", str(draft), "--out", str(tmp_path / "r.json"), "--engine",
               "sglang", "--sglang-serve", "--bench", str(bench), "--max-new-tokens", "8", "--dtype", "fp32",
               "--engine-arg", f"log_dir={tmp_path / 'logs'}"])
    err = capsys.readouterr().err
    assert rc == 2 and not (tmp_path / "r.json").exists()
    assert "sgl_kernel.copy_all_layer_kv_cache_cpu was called" in err and "compatibility module without kernels" in err
    assert "sglang server exited" in err  # at start-up, before any request
    assert (tmp_path / "logs" / "spec" / "server.log").exists()  # the log is kept where log_dir says
