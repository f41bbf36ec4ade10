"""Scale-out: `torchrun --nproc-per-node 2 -m eaglenest train` (gloo, CPU) logs the same losses as
one process with the same global batch, and a rank-0 checkpoint resumes on either rank count."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
    """The real CLI under torchrun: 2 CPU processes on 127.0.0.1, gloo."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flags = []
    for k, v in ARGS.items():
        flags += [f"--{k.replace('_', '-')}", str(v)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(port), "-m", "eaglenest", "train", "--model", str(model), "--features", str(store),
           "--out", str(out), *flags] + (["--resume"] if resume else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "EAGLENEST_NO_PROGRESS": "1"}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    cfg = json.loads((Path(out) / "config.json").read_text())
    assert cfg["world_size"] == 2


def losses(run: Path):
    return [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]


def cut_to_step3(src: Path, dst: Path) -> Path:
    """A copy of a run as if killed right after its step-3 checkpoint."""
    shutil.copytree(src, dst)
    for d in (dst / "checkpoints").glob("step-*"):
        if d.name != "step-00000003":
            shutil.rmtree(d)
    (dst / "checkpoints" / "latest.json").write_text(json.dumps({"step": 3, "dir": "step-00000003"}))
    return dst


def test_two_processes_equal_one_and_resume_on_any_rank_count(tiny_llama_dir, store, tmp_path):
    one = tmp_path / "one"
    run_one(tiny_llama_dir, store, one)
    ref = losses(one)
    assert len(ref) == 6 and len({round(x, 6) for x in ref}) > 3  # not vacuous

    two = tmp_path / "two"
    run_two(tiny_llama_dir, store, two)
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
    run_two(tiny_llama_dir, store, b, resume=True)
    assert losses(b) == pytest.approx(ref, rel=1e-5)
