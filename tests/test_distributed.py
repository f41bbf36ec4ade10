"""Scale-out: `torchrun --nproc-per-node 2 eaglenest train` (gloo, CPU) logs the same losses as
one process with the same global batch, and a rank-0 checkpoint resumes on either rank count.
The torchrun runs go through tests/dist_spy.py, which records each rank's collectives and store
reads: every collective's tensor is on the process group's device, and each rank reads only
its own micro-batches."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_train import keep_only_step3

from eaglenest.train.trainer import TrainConfig, Trainer

ARGS = dict(ttt_steps=3, draft_vocab=500, max_steps=6, lr=3e-3, batch_tokens=256, grad_accum=2, eval_fraction=0.0, save_every=3, device="cpu")


@pytest.fixture(scope="module")
def store(tiny_llama_dir, tmp_path_factory):
    from test_train import fake_samples

    from eaglenest.capture.run import run_capture
    from eaglenest.engines.hf import HFEngine

    out = tmp_path_factory.mktemp("feat_dist")
    with HFEngine(str(tiny_llama_dir), dtype="fp32", device="cpu") as e:
        run_capture(e, fake_samples(n=24, seed=5), out, dtype="fp32", batch_tokens=512)
    return out


def run_one(model, store, out, **kw):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        Trainer(TrainConfig(model=str(model), features=str(store), out=str(out), **{**ARGS, **kw})).fit()
    finally:
        torch.set_num_threads(n)


def run_two(model, store, out, resume=False):
    """The real CLI under torchrun: 2 CPU processes on 127.0.0.1, gloo; returns each rank's spy record."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flags = []
    for k, v in ARGS.items():
        flags += [f"--{k.replace('_', '-')}", str(v)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(port), str(Path(__file__).parent / "dist_spy.py"), str(Path(out) / "spy"), "train", "--model", str(model), "--features", str(store),
           "--out", str(out), *flags] + (["--resume"] if resume else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "EAGLENEST_NO_PROGRESS": "1"}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    cfg = json.loads((Path(out) / "config.json").read_text())
    assert cfg["world_size"] == 2
    return [json.loads((Path(out) / "spy" / f"rank-{r}.json").read_text()) for r in (0, 1)]


def check_collectives_and_reads(spies, store, start_step=0):
    """Issue 13: under NCCL the stats tensor was all-reduced from the CPU.  The rule, checked on
    every collective of a real gloo run: the tensor is on collective_device(the group's backend).
    Issue 15: rank r reads the hidden states of its own micro-batches (every 2nd of a step) only;
    the set-up reads (vocabulary counts, fc statistics) happen on rank 0 and are broadcast."""
    from eaglenest.features import FeatureStore
    from eaglenest.train.data import Schedule, split
    from eaglenest.train.distributed import collective_device

    for spy in spies:
        assert spy["collectives"], "no collective ran"
        for c in spy["collectives"]:
            assert c["device"] == str(collective_device(c["backend"])), c
        assert {c["backend"] for c in spy["collectives"]} == {"gloo"}
    fs = FeatureStore(store)
    train_idx, _ = split(fs, ARGS["eval_fraction"])
    sched = Schedule(fs.lengths(), train_idx, ARGS["batch_tokens"], ARGS["grad_accum"], 0, 2048)
    own = [[], []]  # the samples each rank must read, in the order it reads them
    for st in range(start_step, ARGS["max_steps"]):
        for k, b in enumerate(sched.step_batches(st)[1]):
            own[k % 2] += b
    r0, r1 = spies[0]["reads"], spies[1]["reads"]
    assert own[1] and r1["sample"] == own[1] and not r1["input_ids"] and not r1["loss_mask"]
    setup = [] if start_step else list(range(min(32, len(fs))))  # rank 0: the fc statistics' first samples
    assert own[0] and r0["sample"] == setup + own[0]


def losses(run: Path):
    return [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]


def cut_to_step3(src: Path, dst: Path) -> Path:
    """A copy of a run as if killed right after its step-3 checkpoint."""
    shutil.copytree(src, dst)
    return keep_only_step3(dst)


def test_two_processes_equal_one_and_resume_on_any_rank_count(tiny_llama_dir, store, tmp_path):
    one = tmp_path / "one"
    run_one(tiny_llama_dir, store, one)
    ref = losses(one)
    assert len(ref) == 6 and len({round(x, 6) for x in ref}) > 3  # not vacuous

    two = tmp_path / "two"
    check_collectives_and_reads(run_two(tiny_llama_dir, store, two), store)
    assert losses(two) == pytest.approx(ref, rel=1e-5)
    rows = [json.loads(x) for x in (two / "metrics.jsonl").read_text().splitlines()]
    one_rows = [json.loads(x) for x in (one / "metrics.jsonl").read_text().splitlines()]
    assert [r["tokens"] for r in rows] == [r["tokens"] for r in one_rows]  # the same global batches

    # 2-process checkpoint -> 1 process
    a = cut_to_step3(two, tmp_path / "two_then_one")
    run_one(tiny_llama_dir, store, a, resume=True)
    assert losses(a) == pytest.approx(ref, rel=1e-5)

    # 1-process checkpoint -> 2 processes
    b = cut_to_step3(one, tmp_path / "one_then_two")
    spies = run_two(tiny_llama_dir, store, b, resume=True)
    check_collectives_and_reads(spies, store, start_step=3)
    assert not spies[0]["reads"]["input_ids"]  # a resumed run reads its vocabulary from the run
    assert losses(b) == pytest.approx(ref, rel=1e-5)
