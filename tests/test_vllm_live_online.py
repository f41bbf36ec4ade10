"""Live: online training (`train --online --engine vllm`) from a real vLLM server (SmolLM2, CPU).

Through the fault-injecting proxy (tests/flaky_proxy.py): HTTP 503s and a reset are retried and
their samples trained; a corrupted echo and NaN features are skipped and counted by reason, at
set-up (fc statistics) and in their training step, and the steps train what arrived.  The server
going away mid-run (connections refused for longer than the client's retries) stops the run with
a checkpoint at the step it could not capture and a message that says so; `--resume` against the
server continues there and finishes.  Under torchrun, 2 gloo ranks pull their own samples from a
pool of 2 URLs, each rank starting at its own (counted at the proxy, one of the two).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from flaky_proxy import FlakyProxy
from vllm_helpers import capture_server, make_tiny_data, requires_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow, requires_vllm]

BATCH_TOKENS = 320


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, smollm2):
    return make_tiny_data(tmp_path_factory.mktemp("online_vllm_data"), str(smollm2), n=12, max_length=160)


@pytest.fixture(scope="module")
def server(smollm2):
    """One capture server for the module."""
    with capture_server(smollm2) as url:
        yield url


def train_args(smollm2, data_dir, out, urls, *extra):
    url_flags = [x for u in urls for x in ("--vllm-url", u)]
    return ["train", "--online", "--data", str(data_dir), "--engine", "vllm", *url_flags, "--vllm-concurrency", "3",
            "--vllm-timeout", "60", "--model", str(smollm2), "--out", str(out), "--ttt-steps", "2", "--draft-vocab", "1024",
            "--lr", "1e-3", "--batch-tokens", str(BATCH_TOKENS), "--grad-accum", "1", "--epochs", "1", "--eval-fraction", "0",
            "--device", "cpu", *extra]


def schedule(data_dir):
    """What the run asks for: samples in store order (by length, then position), and its steps."""
    from eaglenest.data import PreparedData
    from eaglenest.train.data import Schedule

    d = PreparedData(data_dir)
    lengths, ids = d.lengths(), d.ids()
    order = sorted(range(len(d)), key=lambda i: (lengths[i], i))
    sched = Schedule([lengths[i] for i in order], list(range(len(d))), BATCH_TOKENS, 1, 0, 2048)
    steps = [[ids[order[i]] for b in sched.step_batches(s)[1] for i in b] for s in range(sched.steps_per_epoch)]
    return d, {ids[i]: lengths[i] for i in range(len(d))}, steps


def rows(path: Path):
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_faults_are_retried_or_skipped_and_counted_and_the_run_finishes(smollm2, data_dir, server, tmp_path):
    from eaglenest.cli import main

    d, length, steps = schedule(data_dir)
    key = {d[i].id: tuple(d[i].input_ids) for i in range(len(d))}
    ids = [d[i].id for i in range(len(d))]
    transient = {ids[0]: ("503", 2), ids[1]: ("reset", 1)}
    persistent = {ids[4]: ("echo", None), ids[5]: ("nan", None)}
    out = tmp_path / "run"
    with FlakyProxy(server, {key[s]: f for s, f in {**transient, **persistent}.items()}) as proxy:
        assert main(train_args(smollm2, data_dir, out, [proxy.url], "--vllm-retries", "4")) == 0
        seen = {sid: proxy.seen(key[sid]) for sid in ids}
    for sid, (kind, n) in transient.items():  # injected as often as asked, then forwarded: trained
        assert seen[sid][:n] == [kind] * n and seen[sid][n:] == ["ok", "ok"], seen[sid]  # set-up + its step
    fails = rows(out / "failures.jsonl")
    want = {ids[4]: "token_mismatch", ids[5]: "non_finite"}
    for phase in ("setup", "train"):  # the fc statistics' samples (all 12 here), then their training step
        assert {f["id"]: f["reason"] for f in fails if f["phase"] == phase} == want
    metrics = rows(out / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(1, len(steps) + 1))
    for r, asked in zip(metrics, steps):  # each step trained exactly its samples that arrived
        assert r["tokens"] == sum(length[s] for s in asked if s not in want)
    final = json.loads((out / "final.json").read_text())["online"]
    assert final["failures"] == {"total": 4, "setup": {"token_mismatch": 1, "non_finite": 1},
                                 "train": {"token_mismatch": 1, "non_finite": 1}}
    # the client's own account (a real timeout of a slow server, retried, would be its own reason)
    assert {k: v for k, v in final["requests"]["failed_attempts"].items() if k != "timeout"} == {"http_5xx": 2, "connection": 1}
    assert final["requests"]["requests_retried"] >= 2 and final["requests"]["requests_failed"] == 0


def test_server_gone_mid_run_stops_with_a_checkpoint_and_resume_finishes(smollm2, data_dir, server, tmp_path, capsys):
    from eaglenest.cli import main

    d, _, steps = schedule(data_dir)
    assert len(steps) >= 4
    victim = steps[2][0]  # its request takes the server away: step 3 cannot be captured
    key = tuple(next(d[i].input_ids for i in range(len(d)) if d[i].id == victim))
    out = tmp_path / "run"
    # no set-up captures (the fault hits step 3); one request at a time: none of step 3's is in flight beside the victim's
    args = ("--vllm-retries", "2", "--fc-init", "random", "--vllm-concurrency", "1")
    with FlakyProxy(server, {key: ("restart", 1)}, down=30.0) as proxy:
        rc = main(train_args(smollm2, data_dir, out, [proxy.url], *args))
    err = capsys.readouterr().err
    assert rc == 2 and "step 3: the engine delivered none of the step's samples" in err and "is the server up?" in err, err[-2000:]
    assert "--resume" in err
    assert json.loads((out / "checkpoints" / "latest.json").read_text())["step"] == 2
    before = rows(out / "metrics.jsonl")
    assert [r["step"] for r in before] == [1, 2]
    assert {f["reason"] for f in rows(out / "failures.jsonl")} == {"connection"}
    assert main(train_args(smollm2, data_dir, out, [server], *args, "--resume")) == 0
    after = rows(out / "metrics.jsonl")
    assert [r["step"] for r in after] == list(range(1, len(steps) + 1)) and after[:2] == before
    assert rows(out / "failures.jsonl") == []  # the stopped step's lines are dropped and it was captured again
    assert json.loads((out / "final.json").read_text())["online"]["failures"] == {"total": 0}


def test_two_gloo_ranks_pull_their_own_samples_from_a_pool_of_urls(smollm2, data_dir, server, tmp_path):
    """Rank r's client starts at URL r % 2 and alternates: the proxy (URL 0) sees exactly
    ceil(n0 / 2) + floor(n1 / 2) captures, n_r = the samples of rank r's micro-batches."""
    _, length, steps = schedule(data_dir)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "two"
    with FlakyProxy(server, {}) as proxy:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(port), "-m", "eaglenest",
               *train_args(smollm2, data_dir, out, [proxy.url, server], "--fc-init", "random", "--grad-accum", "2")]
        r = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", "EAGLENEST_NO_PROGRESS": "1"},
                           capture_output=True, text=True, timeout=900)
        posts = [x for x in proxy.log if x[1] == "/v1/completions"]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert json.loads((out / "config.json").read_text())["world_size"] == 2
    # grad_accum 2: step s = micro-batches 2s (rank 0) and 2s+1 (rank 1) of the one-rank schedule above
    n = [sum(len(steps[k]) for k in range(r0, len(steps) - len(steps) % 2, 2)) for r0 in (0, 1)]
    assert len(posts) == (n[0] + 1) // 2 + n[1] // 2, (len(posts), n)
    metrics = rows(out / "metrics.jsonl")
    assert len(metrics) == len(steps) // 2
    assert [m["tokens"] for m in metrics] == [sum(length[x] for x in steps[2 * s] + steps[2 * s + 1]) for s in range(len(metrics))]

