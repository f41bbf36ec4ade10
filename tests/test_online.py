"""Online training (eaglenest/train/online.py): the engine's hidden states go straight into the
trainer, no feature store.

* Real SmolLM2, fp32, hf engine, through the CLI: the online run's per-step losses (and held-out
  losses) equal those of an offline run -- `capture` to a store, then `train` -- within what fp32
  sums in another order allow, and both runs have the same data fingerprint; RUN_DIR holds only
  checkpoints and logs.
* A tiny random target:
  - `train --online` SIGKILLed mid-run and re-run with --resume ends with the uninterrupted losses;
  - samples the engine fails on are skipped, counted by reason and step (RUN_DIR/failures.jsonl,
    final.json), the rest of their step trained, a step with none left skipped: a real target
    whose embedding row of one token is NaN returns non-finite states for every sample holding it;
  - --max-failures stops the run with a checkpoint; --resume ends where an uninterrupted run ends;
  - an engine that stops answering stops the run after --online-timeout with a checkpoint (no
    deadlock); --resume continues and ends with the uninterrupted losses;
  - torchrun with 2 gloo ranks equals 1 process, and each rank captures only its own micro-batches;
  - the server pool seen by each rank (unit).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from eaglenest import EaglenestError
from eaglenest.train.trainer import TrainConfig, Trainer

POISON = 450  # a token id the fake samples never hold (they draw from [3, 400))


def write_data(out: Path, samples) -> Path:
    from eaglenest.data import Sample, write_prepared

    write_prepared(out, [Sample(s.id, s.input_ids, s.loss_mask) for s in samples], {}, 49152)
    return out


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    from test_train import fake_samples

    return write_data(tmp_path_factory.mktemp("online_data"), fake_samples())


def ocfg(model, data, out, **kw):
    base = dict(model=str(model), online=True, data=str(data), out=str(out), capture_dtype="fp32", ttt_steps=3, draft_vocab=500,
                max_steps=8, lr=3e-3, batch_tokens=256, grad_accum=2, eval_fraction=0.2, device="cpu")
    base.update(kw)
    return TrainConfig(**base)


def rows(run: Path, name="metrics.jsonl"):
    p = run / name
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def losses(run: Path):
    return [r["loss"] for r in rows(run)]


# --- equal to offline, on the real target --------------------------------------------------------
@pytest.mark.slow
def test_online_equals_offline_on_smollm2_fp32(smollm2, smol_data, tmp_path):
    """Issue 16 item 2: same order, fp32, hf engine: per-step losses those of store + train, as far as
    fp32 sums in another order allow."""
    from eaglenest.cli import main

    common = ["--model", str(smollm2), "--ttt-steps", "3", "--draft-vocab", "2048", "--lr", "3e-4", "--batch-tokens", "512",
              "--max-steps", "5", "--eval-fraction", "0.15", "--eval-every", "2", "--device", "cpu", "--dtype", "fp32"]
    feats = tmp_path / "feats"
    assert main(["capture", "--model", str(smollm2), "--data", str(smol_data), "--out", str(feats), "--dtype", "fp32",
                 "--device", "cpu"]) == 0
    assert main(["train", "--features", str(feats), "--out", str(tmp_path / "offline"), *common]) == 0
    online = tmp_path / "online"
    assert main(["train", "--online", "--data", str(smol_data), "--engine", "hf", "--capture-dtype", "fp32",
                 "--out", str(online), *common]) == 0
    off, on = rows(tmp_path / "offline"), rows(online)
    assert [r["step"] for r in on] == [r["step"] for r in off] == list(range(1, 6))
    assert [r["tokens"] for r in on] == [r["tokens"] for r in off]  # the same samples in the same steps
    # Capture's batches and the online micro-batches differ, so the target's fp32 sums run in other
    # orders.  n fp32 terms summed in another order move by up to n*u times the sum of their magnitudes
    # (u = 2**-24, fp32's unit roundoff); the longest sums are the target's down_proj (n = its
    # intermediate size, 1536), so the states, and to first order a loss (a sum of non-negative terms)
    # computed from them, may move by n*u = 9.2e-5 relative.  Measured: 1.5e-5 on a loss of 87.6
    # (1.7e-7) on an AMD EPYC with AVX512-BF16; another sample, layer or mask moves it by percents.
    rel = json.loads((Path(smollm2) / "config.json").read_text())["intermediate_size"] * 2.0**-24
    for a, b in zip(off, on):
        assert abs(a["loss"] - b["loss"]) <= rel * a["loss"], (a["step"], a["loss"], b["loss"])
        if "eval_loss" in a:
            assert b["eval_loss"] == pytest.approx(a["eval_loss"], rel=rel)
    assert len({round(r["loss"], 4) for r in off}) > 3  # not vacuous
    c_off, c_on = (json.loads((d / "config.json").read_text()) for d in (tmp_path / "offline", online))
    assert c_on["identity"] == c_off["identity"]  # same vocabulary source, order, model: one fingerprint
    assert c_on["draft_vocab_coverage"] == c_off["draft_vocab_coverage"]
    mem = c_on["online"]["memory"]
    assert mem["target_params"] > 1e8 and mem["target_bytes"] >= 4 * mem["target_params"]  # the fp32 target, in this process
    written = {p.relative_to(online).parts[0] for p in online.rglob("*") if p.is_file()}
    assert written <= {"checkpoints", "metrics.jsonl", "config.json", "final.json", "failures.jsonl", "vocab.safetensors",
                       "loss.png", "acc.png", "alpha.png", "tau.png"}, written
    assert json.loads((online / "final.json").read_text())["online"]["failures"] == {"total": 0}


# --- kills and resume ----------------------------------------------------------------------------
def test_sigkilled_online_run_resumes_to_the_uninterrupted_losses(tiny_llama_dir, tiny_data, tmp_path):
    full = tmp_path / "full"
    Trainer(ocfg(tiny_llama_dir, tiny_data, full, max_steps=10)).fit()
    run = tmp_path / "killed"
    argv = [sys.executable, "-m", "eaglenest", "train", "--online", "--data", str(tiny_data), "--engine", "hf",
            "--capture-dtype", "fp32", "--model", str(tiny_llama_dir), "--out", str(run), "--ttt-steps", "3",
            "--draft-vocab", "500", "--max-steps", "10", "--lr", "3e-3", "--batch-tokens", "256", "--grad-accum", "2",
            "--eval-fraction", "0.2", "--device", "cpu", "--save-every", "2"]
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while p.poll() is None and len(rows(run)) < 5:  # killed at step 5 or later, however slow the machine
        time.sleep(0.002)
    assert p.poll() is None, "the run finished before it could be killed"
    p.send_signal(signal.SIGKILL)
    p.wait()
    killed_at = json.loads((run / "checkpoints" / "latest.json").read_text())["step"]
    r = subprocess.run(argv + ["--resume"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert [x["step"] for x in rows(run)] == list(range(1, 11))
    assert losses(run) == pytest.approx(losses(full), rel=1e-6, abs=1e-7), killed_at
    assert 2 <= killed_at < 10


# --- failed samples ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def poisoned_target(tmp_path_factory):
    """A tiny Llama (untied head) whose embedding row POISON is NaN: any sample holding that token
    comes back from the hf engine with non-finite states, like a server's NaN."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, vocab_size=49152, max_position_embeddings=2048, rms_norm_eps=1e-5,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2)
    m = LlamaForCausalLM(cfg)
    with torch.no_grad():
        m.model.embed_tokens.weight[POISON] = float("nan")
    d = tmp_path_factory.mktemp("poisoned_target")
    m.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def poisoned_data(tmp_path_factory):
    """24 samples; 4 of them hold POISON and are long (> 40 tokens: alone in an 80-token micro-batch),
    two on each side of the train/held-out split (by their prompts' keys: the poisoned target has no
    tokenizer files, so the key hashes the prompt's ids, train/data.py held_out_mask)."""
    from test_train import fake_samples

    from eaglenest.data.prompts import key_fraction, prompt_ids, prompt_key

    samples = fake_samples(n=24, seed=3)
    for s in samples:  # every sample's poisoned form, to choose from
        s.poisoned = (s.input_ids * 4)[: max(50, len(s.input_ids))], [0] * 10 + [1] * (max(50, len(s.input_ids)) - 10)
    held = [key_fraction(prompt_key(prompt_ids(*s.poisoned))) < 0.25 for s in samples]
    pick = [i for i, h in enumerate(held) if h][:2] + [i for i, h in enumerate(held) if not h][:2]
    for i in pick:
        s = samples[i]
        s.input_ids, s.loss_mask = s.poisoned
        s.input_ids[len(s.input_ids) // 2] = POISON
    d = write_data(tmp_path_factory.mktemp("poisoned_data"), samples)
    return d, {samples[i].id for i in pick}


def test_failed_samples_are_skipped_counted_and_the_rest_of_their_step_trained(poisoned_target, poisoned_data, tmp_path):
    data, bad = poisoned_data
    run = tmp_path / "run"
    t = Trainer(ocfg(poisoned_target, data, run, batch_tokens=80, grad_accum=1, max_steps=None, epochs=1, eval_fraction=0.25,
                     eval_every=1000))
    t.fit()
    ids, lengths = t.store.ids(), t.store.lengths()
    train_ids = {ids[i] for b in t.schedule.batches for i in b}
    eval_ids = {ids[i] for b in t.eval_batches for i in b}
    assert bad & train_ids and bad & eval_ids  # the fixture puts poison on both sides of the split
    fails = rows(run, "failures.jsonl")
    assert {f["reason"] for f in fails} == {"non_finite"}
    by_phase = {ph: sorted(f["id"] for f in fails if f["phase"] == ph) for ph in ("setup", "train", "eval")}
    assert by_phase["setup"] == sorted(bad)  # the fc statistics' first 32 samples: all 24
    assert by_phase["train"] == sorted(bad & train_ids)  # each once: one epoch
    assert by_phase["eval"] == sorted(bad & eval_ids)  # one evaluation, at the end
    # each step trained exactly its samples that arrived; a step with none left is skipped (no row)
    logged = {r["step"]: r for r in rows(run)}
    skipped = 0
    for s in range(t.total_steps):
        kept = [i for b in t.schedule.step_batches(s)[1] for i in b if ids[i] not in bad]
        if not kept:
            skipped += 1
            assert logged[s + 1]["tokens"] == 0 and logged[s + 1]["skipped"]
            assert [f["step"] for f in fails if f["phase"] == "train" and f["id"] in {ids[i] for b in t.schedule.step_batches(s)[1] for i in b}] == [s + 1]
        else:
            assert logged[s + 1]["tokens"] == sum(min(lengths[i], 2048) for i in kept)
    assert skipped == len(bad & train_ids)  # the poisoned samples are alone in their micro-batches
    final = json.loads((run / "final.json").read_text())
    assert final["step"] == t.total_steps
    assert final["online"]["failures"] == {"total": len(fails), "setup": {"non_finite": len(bad)},
                                           "train": {"non_finite": len(bad & train_ids)}, "eval": {"non_finite": len(bad & eval_ids)}}


def test_max_failures_stops_with_a_checkpoint_and_resume_ends_like_an_uninterrupted_run(poisoned_target, poisoned_data, tmp_path):
    data, _ = poisoned_data
    kw = dict(batch_tokens=80, grad_accum=1, max_steps=None, epochs=1, eval_fraction=0.25, eval_every=1000, save_every=1000)
    full = tmp_path / "full"
    Trainer(ocfg(poisoned_target, data, full, **kw)).fit()
    run = tmp_path / "run"
    with pytest.raises(EaglenestError, match=r"2 failed samples exceed --max-failures 1.*--resume to continue from there") as e:
        Trainer(ocfg(poisoned_target, data, run, max_failures=1, **kw)).fit()
    train_fails = [f for f in rows(full, "failures.jsonl") if f["phase"] == "train"]
    stop = train_fails[1]["step"]  # the step of the second failure
    assert json.loads((run / "checkpoints" / "latest.json").read_text())["step"] == stop - 1, str(e.value)
    Trainer(ocfg(poisoned_target, data, run, resume=True, **kw)).fit()
    assert [r["step"] for r in rows(run)] == [r["step"] for r in rows(full)]
    assert losses(run) == pytest.approx(losses(full), rel=1e-6, abs=1e-7)
    strip = lambda fs: sorted((f["step"], f["phase"], f["id"], f["reason"]) for f in fs)  # noqa: E731
    assert strip(rows(run, "failures.jsonl")) == strip(rows(full, "failures.jsonl"))  # lines past the checkpoint redone once


def test_an_engine_that_stops_answering_stops_the_run_after_the_timeout_and_resume_continues(tiny_llama_dir, tiny_data, tmp_path):
    """No deadlock: a capture that never returns (a hung server) stops the loop after
    --online-timeout with a clear message and a checkpoint at the step it waited for."""
    from eaglenest.engines.hf import HFEngine

    class Hangs(HFEngine):
        def __init__(self, *a, hang_on: str, release: threading.Event, **kw):
            super().__init__(*a, **kw)
            self.hang_on, self.release = hang_on, release
            self.hanging = False

        def capture(self, batch):
            if any(r.id == self.hang_on for r in batch):
                self.hanging = True
                # released by the test once the run stopped; the bound only turns a deadlocked run (one
                # that waits for this capture instead of timing out) into a failure instead of a hang
                self.release.wait(timeout=600)
                self.hanging = False
            return super().capture(batch)

    # set-up captures (fc statistics) are bounded by the engine's own timeouts, not by --online-timeout
    kw = dict(max_steps=8, fc_init="random", eval_fraction=0.0, batch_tokens=128, grad_accum=1)
    full = tmp_path / "full"
    t = Trainer(ocfg(tiny_llama_dir, tiny_data, full, **kw))
    t.fit()
    assert t.schedule.steps_per_epoch > 4
    victim = t.store.ids()[t.schedule.step_batches(4)[1][0][0]]  # in 0-based step 4 (the 5th) only: one epoch
    release = threading.Event()
    run = tmp_path / "run"
    engine = Hangs(str(tiny_llama_dir), dtype="fp32", device="cpu", hang_on=victim, release=release)
    with pytest.raises(EaglenestError, match=r"step 5: its micro-batches did not arrive within --online-timeout 5 s"):
        Trainer(ocfg(tiny_llama_dir, tiny_data, run, online_timeout=5.0, **kw), engine=engine).fit()
    assert engine.hanging  # the run stopped while the capture still hung: --online-timeout did it
    assert json.loads((run / "checkpoints" / "latest.json").read_text())["step"] == 4
    release.set()
    engine.close()
    Trainer(ocfg(tiny_llama_dir, tiny_data, run, resume=True, **kw)).fit()
    assert losses(run) == pytest.approx(losses(full), rel=1e-6, abs=1e-7)


# --- many processes, many servers ----------------------------------------------------------------
def test_two_gloo_ranks_equal_one_process_and_capture_only_their_own(tiny_llama_dir, tiny_data, tmp_path):
    kw = dict(max_steps=6, grad_accum=2, eval_fraction=0.0)
    one = tmp_path / "one"
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t = Trainer(ocfg(tiny_llama_dir, tiny_data, one, **kw))
        t.fit()
    finally:
        torch.set_num_threads(n)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    two = tmp_path / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(port), str(Path(__file__).parent / "dist_spy.py"), str(two / "spy"), "train", "--online",
           "--data", str(tiny_data), "--engine", "hf", "--capture-dtype", "fp32", "--model", str(tiny_llama_dir), "--out", str(two),
           "--ttt-steps", "3", "--draft-vocab", "500", "--max-steps", "6", "--lr", "3e-3", "--batch-tokens", "256",
           "--grad-accum", "2", "--eval-fraction", "0.0", "--device", "cpu"]
    r = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", "EAGLENEST_NO_PROGRESS": "1"}, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert losses(two) == pytest.approx(losses(one), rel=1e-5)
    assert [x["tokens"] for x in rows(two)] == [x["tokens"] for x in rows(one)]
    spies = [json.loads((two / "spy" / f"rank-{k}.json").read_text()) for k in (0, 1)]
    ids = t.store.ids()
    own = [[], []]
    for s in range(6):
        for k, b in enumerate(t.schedule.step_batches(s)[1]):
            own[k % 2] += [ids[i] for i in b]
    setup = ids[:32]  # rank 0 alone captures the fc statistics' first samples
    assert spies[0]["captured"] == setup + own[0] and spies[1]["captured"] == own[1]


def test_each_rank_uses_every_server_starting_at_its_own():
    from eaglenest.train.online import rank_urls

    for n_servers in range(1, 5):
        urls = [f"http://s{k}" for k in range(n_servers)]
        for world in range(1, 7):
            firsts = [rank_urls(urls, r)[0] for r in range(world)]
            for r in range(world):
                assert sorted(rank_urls(urls, r)) == urls  # failover: every rank can reach every server
            counts = [firsts.count(u) for u in urls]
            assert max(counts) - min(counts) <= 1  # ranks spread evenly over the servers, whichever is larger
    assert rank_urls(["a", "b", "c"], 4) == ["b", "c", "a"]


def test_online_options_and_engine_flags():
    """The train CLI takes capture's engine flags (one group per engine, --device shared with the
    hf engine); inconsistent online options are one-line errors; a server engine under torchrun
    needs running servers (a server per rank is not started)."""
    from eaglenest.cli import build_parser
    from eaglenest.train.online import make_engine

    a = build_parser().parse_args(["train", "--online", "--data", "d", "--model", "m", "--out", "o", "--engine", "vllm",
                                   "--vllm-url", "http://a", "--vllm-url", "http://b", "--sglang-batch", "2", "--device", "cpu"])
    assert a.vllm_url == ["http://a", "http://b"] and a.sglang_batch == 2 and a.device == "cpu" and a.engine == "vllm"
    for kw, msg in ((dict(online=True), "--online trains from --data"), (dict(online=True, data="d", features="f"), "takes no --features"),
                    (dict(), "--features FEAT_DIR is required"), (dict(features="f", data="d"), "--features FEAT_DIR is required"),
                    (dict(online=True, data="d", online_timeout=0), "--online-timeout must be positive")):
        with pytest.raises(EaglenestError, match=msg):
            TrainConfig(model="m", out="o", **kw).validate()
    for engine in ("vllm", "sglang"):
        with pytest.raises(EaglenestError, match=f"--online --engine {engine} under torchrun needs running servers"):
            make_engine(TrainConfig(model="m", out="o", online=True, data="d", engine=engine), None, "cpu", rank=1, world=2)


def test_a_server_unreachable_at_start_is_an_error_not_a_silent_random_init(smollm2, tiny_data, tmp_path, capsys):
    """The fc statistics come from the first captured samples: if none arrives (nothing listens at
    --vllm-url), the run stops with the reason instead of falling back to a random fc."""
    from eaglenest.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"  # closed again: connections are refused
    rc = main(["train", "--online", "--data", str(tiny_data), "--engine", "vllm", "--vllm-url", url, "--vllm-retries", "0",
               "--model", str(smollm2), "--out", str(tmp_path / "run"), "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2 and "the engine delivered none of the first samples for the fc statistics (connection" in err, err[-2000:]
    assert {f["reason"] for f in rows(tmp_path / "run", "failures.jsonl")} == {"connection"}
