"""Issue 22.2: training never dies where it could checkpoint, and never loses a run.

* A micro-batch with no loss position (--max-len below the prepared length, or a sample whose
  only assistant turn is cut) trains on, counted in metrics.jsonl and final.json; under torchrun
  with 2 gloo ranks where one rank alone gets such a micro-batch: no hang, the losses and the
  weights of one process.
* A slow rank: the process group's timeout comes from the run's own timeouts, so a rank waiting
  --online-timeout for its engine stops every rank with a checkpoint even where the backend's
  default collective timeout is shorter (NCCL's 10 min against --online-timeout 600 s, played by
  gloo with a 2 s default).
* Any error in the loop after step k leaves a checkpoint at step k and says how to --resume; the
  prefetcher's timeout is the built-in TimeoutError on every Python (3.10's futures have their own).
* Checkpoints: files and directory fsynced before the rename that publishes them; a kill between
  write and publish (also of a re-save of the step latest.json names) leaves the previous one
  loadable; --keep-checkpoints N; --save-every-min with a fake clock.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_online import ocfg, tiny_data  # noqa: F401 -- fixtures and helpers shared with the online tests
from test_train import cfg, fake_samples, losses, tiny_store  # noqa: F401

from eaglenest import EaglenestError
from eaglenest.train import checkpoint as ckpt_mod
from eaglenest.train.checkpoint import Checkpointer
from eaglenest.train.trainer import TrainConfig, Trainer

TESTS = Path(__file__).parent


def rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(argv: list[str], env: dict | None = None, script: str | None = None) -> subprocess.CompletedProcess:
    """`eaglenest ARGV` under torchrun, 2 CPU processes on 127.0.0.1 (gloo); `script` instead of the
    package when the ranks need a test harness around the real CLI."""
    entry = [str(TESTS / script)] if script else ["-m", "eaglenest"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), *entry, *argv]
    return subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", "EAGLENEST_NO_PROGRESS": "1", **(env or {})},
                          capture_output=True, text=True, timeout=300)


def one_thread(fn):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(n)


# --- micro-batches without loss positions ---------------------------------------------------------
DIST = dict(ttt_steps=3, draft_vocab=500, max_steps=6, lr=3e-3, batch_tokens=128, grad_accum=2, eval_fraction=0.0, device="cpu")


def masked_copy(src: Path, dst: Path, zero: set[int]) -> Path:
    """A copy of a store (same order, same lengths, so the same schedule) whose samples `zero` have
    no assistant token: what `prepare --loss-on last` gives for a conversation whose last turn is cut."""
    from eaglenest.features import FeatureStore
    from eaglenest.features.store import FeatureWriter

    fs = FeatureStore(src)
    w = FeatureWriter(dst, fs.meta)
    for i in range(len(fs)):
        raw = fs.load_stored(i)
        if i in zero:
            raw = {**raw, "loss_mask": torch.zeros_like(raw["loss_mask"])}
        w.write_batch([(fs.entries[i]["id"], raw)], encoded=True)
    return dst


def test_micro_batches_without_loss_positions_train_on_counted_on_every_rank(tiny_llama_dir, tiny_store, tmp_path):
    """Before: loss.backward() raised on the empty micro-batch (a loss without a graph) and the
    other rank was left in the step's all-reduce.  Rank 0 alone gets an empty micro-batch at step
    2, rank 1 alone at step 4, both at step 3 (that step makes no update on any rank)."""
    from eaglenest.features import FeatureStore
    from eaglenest.train.data import Schedule

    fs = FeatureStore(tiny_store)
    sched = Schedule(fs.lengths(), list(range(len(fs))), DIST["batch_tokens"], DIST["grad_accum"], 0, 2048)
    assert sched.steps_per_epoch >= 4
    steps = [sched.step_batches(s)[1] for s in range(DIST["max_steps"])]
    zero = set(steps[1][0]) | set(steps[2][0]) | set(steps[2][1]) | set(steps[3][1])
    store = masked_copy(tiny_store, tmp_path / "feat", zero)
    expect = [sum(all(i in zero for i in b) for b in st) for st in steps]  # empty micro-batches per step
    assert expect[1:4] == [1, 2, 1] and sum(expect) < 2 * len(expect)  # not vacuous: empty and full steps

    one = tmp_path / "one"
    one_thread(lambda: Trainer(TrainConfig(model=str(tiny_llama_dir), features=str(store), out=str(one), **DIST)).fit())
    flags = [x for k, v in DIST.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    two = tmp_path / "two"
    r = torchrun(["train", "--model", str(tiny_llama_dir), "--features", str(store), "--out", str(two), *flags])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

    for run in (one, two):
        got = rows(run)
        assert [x["empty_micro_batches"] for x in got] == expect
        assert got[2]["grad_norm"] == 0.0 and got[2]["loss"] == 0.0  # the all-empty step: no update
        assert json.loads((run / "final.json").read_text())["empty_micro_batches"] == sum(expect)
    assert losses(two) == pytest.approx(losses(one), rel=1e-5)
    assert len({round(x, 6) for x in losses(one)}) > 3
    a = load_file(str(one / "checkpoints" / "step-00000006" / "model.safetensors"))
    b = load_file(str(two / "checkpoints" / "step-00000006" / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6)  # the same updates
    assert "micro-batches had no loss position" in r.stderr


def test_max_len_below_the_prepared_length_trains_on(tiny_llama_dir, tiny_store, tmp_path, capsys):
    """The CLI path of the issue: --max-len 14 cuts the samples of 42 tokens or more before their
    first assistant token (fake samples: the first third of each is prompt); one sample per
    micro-batch, so theirs are empty."""
    from eaglenest.cli import main

    run = tmp_path / "run"
    argv = ["train", "--model", str(tiny_llama_dir), "--features", str(tiny_store), "--out", str(run), "--ttt-steps", "3",
            "--draft-vocab", "500", "--max-steps", "8", "--batch-tokens", "20", "--max-len", "14", "--eval-fraction", "0",
            "--device", "cpu"]
    assert main(argv) == 0
    got = rows(run)
    assert len(got) == 8 and any(x["empty_micro_batches"] for x in got) and any(x["loss"] > 0 for x in got)
    total = sum(x["empty_micro_batches"] for x in got)
    assert json.loads((run / "final.json").read_text())["empty_micro_batches"] == total
    assert f"{total} micro-batches had no loss position" in capsys.readouterr().err


# --- a slow rank, a short default collective timeout ---------------------------------------------
def test_a_slow_rank_stops_every_rank_with_a_checkpoint_past_a_short_default_collective_timeout(tiny_llama_dir, tiny_data, tmp_path):
    """Rank 1's engine never answers for one sample of step 5; rank 0 waits for it in the step's
    verdict.  The backend's default collective timeout (2 s here, NCCL's 10 min in production) is
    shorter than --online-timeout (8 s here, 600 s by default): before, rank 0's collective timed out
    and the job died; now the group's timeout comes from the run's own timeouts and both ranks stop
    together with a checkpoint at step 4 and the reason."""
    kw = dict(max_steps=8, fc_init="random", eval_fraction=0.0, batch_tokens=128, grad_accum=2)
    probe = Trainer(ocfg(tiny_llama_dir, tiny_data, tmp_path / "probe", **kw))  # the run's schedule, to pick rank 1's sample
    probe.close_engine()
    assert probe.schedule.steps_per_epoch > 5
    victim = probe.store.ids()[probe.schedule.step_batches(4)[1][1][0]]  # 0-based step 4, micro-batch 1 = rank 1's
    run = tmp_path / "run"
    argv = ["train", "--online", "--data", str(tiny_data), "--engine", "hf", "--capture-dtype", "fp32", "--model", str(tiny_llama_dir),
            "--out", str(run), "--ttt-steps", "3", "--draft-vocab", "500", "--max-steps", "8", "--batch-tokens", "128",
            "--grad-accum", "2", "--eval-fraction", "0", "--fc-init", "random", "--device", "cpu", "--online-timeout", "8"]
    r = torchrun(argv, env={"SLOW_RANK": "1", "SLOW_SAMPLE": victim, "DEFAULT_PG_TIMEOUT_S": "2"}, script="dist_slow_rank.py")
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert json.loads((run / "checkpoints" / "latest.json").read_text())["step"] == 4, out[-3000:]
    assert "step 5: its micro-batches did not arrive within --online-timeout 8 s" in out, out[-3000:]  # rank 1
    assert "another rank's micro-batches did not arrive" in out, out[-3000:]  # rank 0: the coordinated stop
    assert "--resume to continue from there" in out


def test_the_collective_timeout_outlasts_the_online_timeout():
    from eaglenest.train.distributed import collective_timeout

    base = dict(model="m", out="o", features="f")
    assert collective_timeout(TrainConfig(**base)) >= 1800  # rank 0's evaluation and checkpoint
    on = TrainConfig(model="m", out="o", online=True, data="d", online_timeout=3600)
    assert collective_timeout(on) >= 3600 + 1800
    assert collective_timeout(TrainConfig(**base, dist_timeout=90)) == 90
    with pytest.raises(EaglenestError, match="--dist-timeout 600 must exceed --online-timeout 600"):
        TrainConfig(model="m", out="o", online=True, data="d", dist_timeout=600).validate()


# --- errors that end a run --------------------------------------------------------------------------
def test_an_error_in_the_loop_leaves_a_checkpoint_at_its_step_and_resume_continues(tiny_llama_dir, tiny_store, tmp_path, capsys):
    full = tmp_path / "full"
    Trainer(cfg(tiny_llama_dir, tiny_store, full, max_steps=6)).fit()
    run = tmp_path / "run"
    t = Trainer(cfg(tiny_llama_dir, tiny_store, run, max_steps=6))
    real = t.optimizer_step

    def fails_at_step_4(data):
        if data.step == 3:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(data)

    t.optimizer_step = fails_at_step_4
    with pytest.raises(RuntimeError, match="illegal memory access"):
        t.fit()
    assert json.loads((run / "checkpoints" / "latest.json").read_text())["step"] == 3
    err = capsys.readouterr().err
    assert "training stopped at step 3 by RuntimeError" in err and "step-00000003" in err and "--resume" in err
    Trainer(cfg(tiny_llama_dir, tiny_store, run, max_steps=6, resume=True)).fit()
    assert losses(run) == pytest.approx(losses(full), rel=1e-6, abs=1e-7)


def test_the_prefetch_timeout_is_the_builtin_timeout_error_on_every_python(monkeypatch):
    """Python 3.10's concurrent.futures.TimeoutError is not the built-in TimeoutError the trainer
    catches (3.11 made them one): played here by giving the futures module 3.10's own class."""
    import concurrent.futures
    import concurrent.futures._base as futures_base

    from eaglenest.train.loader import Prefetcher

    class Py310FuturesTimeout(futures_base.Error):  # 3.10: `class TimeoutError(Error)` in concurrent/futures/_base.py
        pass

    monkeypatch.setattr(futures_base, "TimeoutError", Py310FuturesTimeout)  # what Future.result raises
    monkeypatch.setattr(concurrent.futures, "TimeoutError", Py310FuturesTimeout)  # the same class, exported
    release = threading.Event()

    class Hung:
        def load(self, step):
            release.wait()
            return step

    with Prefetcher(Hung(), depth=1) as p:
        with pytest.raises(TimeoutError):
            p.get(0, timeout=0.05)
        release.set()
        assert p.get(0) == 0


# --- checkpoints --------------------------------------------------------------------------------------
class Tiny(torch.nn.Linear):
    def exported_state_dict(self):
        return self.state_dict()


def tiny_run_state(seed: int):
    torch.manual_seed(seed)
    m = Tiny(4, 3)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return m, opt, sched


def loaded_weight(run: Path) -> torch.Tensor:
    m, opt, sched = tiny_run_state(99)
    Checkpointer(run).load(m, opt, sched)
    return m.weight.detach().clone()


KILL_ON_PUBLISH = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from test_train_reliability import tiny_run_state
from eaglenest.train import checkpoint
from eaglenest.train.checkpoint import Checkpointer

c = Checkpointer({run!r})
real = os.replace
def replace(src, dst, *a, **kw):
    if str(src).endswith(".partial"):  # written, about to be published
        os.kill(os.getpid(), signal.SIGKILL)
    return real(src, dst, *a, **kw)
checkpoint.os.replace = replace
m, opt, sched = tiny_run_state({seed})
c.save({step}, 10, m, opt, sched)
"""


def test_a_kill_between_write_and_publish_leaves_the_previous_checkpoint_loadable(tmp_path):
    """SIGKILL (no clean-up runs) at the rename that would publish a checkpoint: of a new step, and
    of a re-save of the very step latest.json names (before, that one was deleted first)."""
    run = tmp_path / "run"
    m, opt, sched = tiny_run_state(1)
    Checkpointer(run).save(2, 10, m, opt, sched)
    saved = m.weight.detach().clone()
    for step in (3, 2):  # a new step, then the step latest.json names
        p = subprocess.run([sys.executable, "-c", KILL_ON_PUBLISH.format(tests=str(TESTS), run=str(run), seed=7, step=step)],
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
        assert Checkpointer(run).latest_step() == 2
        assert torch.equal(loaded_weight(run), saved)
    # a finished re-save of the latest step replaces it (never deleted before the new one is published)
    m2, opt2, sched2 = tiny_run_state(5)
    d = Checkpointer(run).save(2, 10, m2, opt2, sched2)
    assert Checkpointer(run).latest() == d and torch.equal(loaded_weight(run), m2.weight.detach())
    assert [x.name for x in (run / "checkpoints").iterdir() if x.is_dir()] == [d.name]  # the old copy and the torn ones are gone


def test_checkpoint_files_and_directory_are_fsynced_before_the_rename_that_publishes_them(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst, *a, **kw):
        events.append(("replace", str(src), str(dst)))
        return real_replace(src, dst, *a, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    run = tmp_path / "run"
    d = Checkpointer(run).save(1, 10, *tiny_run_state(0))
    publish = next(i for i, e in enumerate(events) if e[0] == "replace" and e[2] == str(d))
    synced = set()
    for e in events[:publish]:  # a file fsynced under a temporary name counts under the name it was renamed to
        if e[0] == "fsync" or e[1] in synced:
            synced.add(e[-1])
    tmp = str(d) + ".partial"
    assert {f"{tmp}/model.safetensors", f"{tmp}/state.pt", f"{tmp}/trainer_state.json", tmp} <= synced, synced
    latest = next(i for i, e in enumerate(events) if e[0] == "replace" and e[2].endswith("latest.json"))
    assert ("fsync", str(run / "checkpoints")) in events[publish:latest]  # the rename is durable before latest.json names it


def test_keep_checkpoints_removes_the_older_ones(tiny_llama_dir, tiny_store, tmp_path):
    run = tmp_path / "run"
    Trainer(cfg(tiny_llama_dir, tiny_store, run, max_steps=6, save_every=1, keep_checkpoints=2)).fit()
    assert sorted(d.name for d in (run / "checkpoints").iterdir() if d.is_dir()) == ["step-00000005", "step-00000006"]
    c = Checkpointer(run, keep=3)
    for step in range(7, 12):
        c.save(step, 20, *tiny_run_state(step))
    assert sorted(d.name for d in (run / "checkpoints").iterdir() if d.is_dir()) == [f"step-{s:08d}" for s in (9, 10, 11)]
    assert c.latest_step() == 11
    run3 = tmp_path / "run3"  # the default keeps 3
    Trainer(cfg(tiny_llama_dir, tiny_store, run3, max_steps=5, save_every=1)).fit()
    assert sorted(d.name for d in (run3 / "checkpoints").iterdir() if d.is_dir()) == [f"step-{s:08d}" for s in (3, 4, 5)]
    c0 = Checkpointer(tmp_path / "all", keep=0)  # 0 keeps every checkpoint
    for step in range(1, 6):
        c0.save(step, 20, *tiny_run_state(step))
    assert len([d for d in (tmp_path / "all" / "checkpoints").iterdir() if d.is_dir()]) == 5


def test_save_every_min_saves_by_training_time(tiny_llama_dir, tiny_store, tmp_path, monkeypatch):
    """A fake clock: each optimizer step takes 7 minutes.  The default --save-every-min 30 saves
    after 35 and 70 minutes (steps 5 and 10) and at the end; --save-every-min 0 only at the end."""
    t = Trainer(cfg(tiny_llama_dir, tiny_store, tmp_path / "run", max_steps=12))
    monkeypatch.setattr(ckpt_mod, "monotonic", lambda: t.step * 7 * 60.0)
    t.fit()
    assert sorted(d.name for d in (tmp_path / "run" / "checkpoints").iterdir() if d.is_dir()) == \
        ["step-00000005", "step-00000010", "step-00000012"]
    t = Trainer(cfg(tiny_llama_dir, tiny_store, tmp_path / "off", max_steps=12, save_every_min=0))
    t.fit()
    assert sorted(d.name for d in (tmp_path / "off" / "checkpoints").iterdir() if d.is_dir()) == ["step-00000012"]
