"""Trainer behaviour on a tiny random target: resume equality, store/target mismatch, outputs;
vocab mapping; the export contract and check-draft."""

import json
import os
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch
from safetensors import safe_open

from eaglenest import EaglenestError
from eaglenest.draft.vocab import build_vocab, check_vocab, draft_ids_to_target, target_to_draft_index
from eaglenest.train.trainer import TrainConfig, Trainer


def fake_samples(n=30, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        T = int(torch.randint(16, 80, (1,), generator=g))
        ids = torch.randint(3, 400, (T,), generator=g).tolist()
        out.append(NS(id=f"s{i}", input_ids=ids, loss_mask=[0] * (T // 3) + [1] * (T - T // 3)))
    return out


@pytest.fixture(scope="module")
def tiny_store(tiny_llama_dir, tmp_path_factory):
    from eaglenest.capture.run import run_capture
    from eaglenest.engines.hf import HFEngine

    out = tmp_path_factory.mktemp("feat")
    with HFEngine(str(tiny_llama_dir), dtype="fp32", device="cpu") as e:
        run_capture(e, fake_samples(), out, dtype="fp32", batch_tokens=512)
    return out


def cfg(tiny_llama_dir, store, out, **kw):
    base = dict(model=str(tiny_llama_dir), features=str(store), out=str(out), ttt_steps=3, draft_vocab=500,
                max_steps=8, lr=3e-3, batch_tokens=256, grad_accum=2, eval_fraction=0.2, device="cpu")
    base.update(kw)
    return TrainConfig(**base)


def losses(run: Path):
    return [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]


def keep_only_step3(run: Path) -> Path:
    """A run as if killed right after its step-3 checkpoint: the other checkpoints gone, latest.json at step 3."""
    import shutil

    for d in (run / "checkpoints").glob("step-*"):
        if d.name != "step-00000003":
            shutil.rmtree(d)
    (run / "checkpoints" / "latest.json").write_text(json.dumps({"step": 3, "dir": "step-00000003"}))
    return run


def test_resume_reproduces_uninterrupted_losses(tiny_llama_dir, tiny_store, tmp_path):
    full = tmp_path / "full"
    Trainer(cfg(tiny_llama_dir, tiny_store, full)).fit()
    part = tmp_path / "part"
    Trainer(cfg(tiny_llama_dir, tiny_store, part, max_steps=8, save_every=3)).fit()
    keep_only_step3(part)  # simulate a kill after the step-3 checkpoint
    Trainer(cfg(tiny_llama_dir, tiny_store, part, resume=True)).fit()
    a, b = losses(full), losses(part)
    assert len(a) == len(b) == 8
    assert a == pytest.approx(b, rel=1e-6, abs=1e-7)
    # different losses across steps (the test would be vacuous otherwise)
    assert len({round(x, 6) for x in a}) > 4
    for name in ("loss.png", "acc.png", "final.json", "vocab.safetensors"):
        assert (full / name).exists()


def test_argmax_cache_of_later_epochs_changes_nothing(tiny_llama_dir, tiny_store, tmp_path, monkeypatch):
    """Epochs >= 2 take the target's argmax from the per-micro-batch cache: same losses and
    accuracies as recomputing it, and the cache really is used (it holds every micro-batch)."""
    import eaglenest.train.trainer as trainer_mod

    spe = Trainer(cfg(tiny_llama_dir, tiny_store, tmp_path / "probe", grad_accum=1)).schedule.steps_per_epoch
    t = Trainer(cfg(tiny_llama_dir, tiny_store, tmp_path / "cached", grad_accum=1, max_steps=2 * spe + 1))  # into a 3rd epoch
    t.fit()
    assert set(map(tuple, t.schedule.batches)) <= set(t.objective._argmax)
    monkeypatch.setattr(trainer_mod, "ARGMAX_CACHE_TOKENS", 0)
    t2 = Trainer(cfg(tiny_llama_dir, tiny_store, tmp_path / "plain", grad_accum=1, max_steps=2 * spe + 1))
    t2.fit()
    assert not t2.objective._argmax
    rows = lambda run: [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    a, b = rows(tmp_path / "cached"), rows(tmp_path / "plain")
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=1e-6)
    assert [r["train_acc"] for r in a] == [r["train_acc"] for r in b]


def test_cpu_attention_follows_the_dtype_and_bf16_kernels_agree(tiny_llama_dir, tiny_store, tmp_path):
    """--attn-impl auto on a CPU: torch's flash kernel (sdpa) under bf16 autocast, the eager reference in
    fp32; and the bf16 run's losses with the flash kernel stay close to eager's over the same steps."""
    from eaglenest.draft.kernels import SdpaCausal

    t32 = Trainer(cfg(tiny_llama_dir, tiny_store, tmp_path / "fp32", dtype="fp32"))
    assert t32.attn_impl == "eager" and t32.attn is None
    runs = {}
    for impl in ("auto", "eager"):
        t = Trainer(cfg(tiny_llama_dir, tiny_store, tmp_path / impl, dtype="bf16", attn_impl=impl, max_steps=4))
        if impl == "auto":
            assert t.attn_impl == "sdpa" and isinstance(t.attn, SdpaCausal)
        t.fit()
        runs[impl] = losses(tmp_path / impl)
    assert len(runs["auto"]) == 4
    for a, b in zip(runs["auto"], runs["eager"]):
        assert abs(a - b) <= 0.01 * abs(b), runs  # measured ~1e-6 apart (Intel AMX); bf16 rounding elsewhere


def test_training_reduces_heldout_loss(tiny_llama_dir, tiny_store, tmp_path):
    r = Trainer(cfg(tiny_llama_dir, tiny_store, tmp_path / "r", max_steps=25, eval_every=24, grad_accum=1)).fit()
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    evals = [x["eval_loss"][0] for x in rows if "eval_loss" in x]
    assert len(evals) >= 2 and evals[-1] < evals[0]
    assert r["eval"]["acc"][0] >= 0 and len(r["eval"]["expected_tau"]) == 3


def test_store_from_another_target_is_rejected(smollm2, tiny_store, tmp_path):
    with pytest.raises(EaglenestError, match="captured from"):
        Trainer(TrainConfig(model=str(smollm2), features=str(tiny_store), out=str(tmp_path / "x"), device="cpu"))


def test_vocab_mapping_round_trip():
    counts = torch.tensor([0, 9, 3, 3, 0, 7, 1, 0, 5, 2])
    d2t, t2d = build_vocab(counts, 5, always=[4])
    tgt = draft_ids_to_target(d2t)
    assert tgt.tolist() == sorted(tgt.tolist())
    assert set(tgt.tolist()) == {1, 5, 8, 2, 4}  # top-4 by count (ties: lower id) + forced id 4
    assert check_vocab(d2t, t2d) is None
    inv = target_to_draft_index(t2d)
    assert (draft_ids_to_target(d2t)[inv[tgt]] == tgt).all()
    assert (inv[~t2d] == -1).all()
    # fewer occurring tokens than K: deterministic fill by id
    d2t2, _ = build_vocab(torch.zeros(10, dtype=torch.long), 3)
    assert draft_ids_to_target(d2t2).tolist() == [0, 1, 2]
    # ... but never with an excluded id (specials) while another never-seen token is left; a seen one keeps its count
    fill = lambda c, k, ex: draft_ids_to_target(build_vocab(c, k, filler_excluded=ex)[0]).tolist()  # noqa: E731
    assert fill(torch.zeros(10), 3, [0, 1, 5]) == [2, 3, 4]
    assert fill(torch.tensor([0, 4, 0, 0, 0, 0]), 3, [0, 1]) == [1, 2, 3]
    assert fill(torch.zeros(4), 4, [0, 2]) == [0, 1, 2, 3]  # K = V: everything, excluded ones last in line
    assert fill(torch.zeros(10), 3, [-1, 99]) == [0, 1, 2]  # ids outside the vocabulary are ignored
    bad = d2t.clone()
    bad[1] = bad[0] - 1  # duplicate target id
    assert "increasing" in check_vocab(bad, t2d)


def test_export_contract_and_check(tiny_llama_dir, tiny_store, tmp_path):
    from eaglenest.cli import main
    from eaglenest.export.check import check_draft

    run = tmp_path / "run"
    Trainer(cfg(tiny_llama_dir, tiny_store, run, max_steps=2)).fit()
    out = tmp_path / "draft"
    assert main(["export", "--run", str(run), "--out", str(out)]) == 0
    c = json.loads((out / "config.json").read_text())
    assert c["architectures"] == ["LlamaForCausalLMEagle3"] and c["num_hidden_layers"] == 1
    assert c["draft_vocab_size"] == 500 and c["vocab_size"] == 49152 and c["tie_word_embeddings"] is False
    assert c["max_position_embeddings"] >= 2048 and c["rope_theta"] == 10000.0
    assert "eagle_aux_hidden_state_layer_ids" not in c  # canonical ids [2, 4, 5]: left to the engines
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    H = 64
    assert keys == {
        "fc.weight": ((H, 3 * H), "BF16"),
        "midlayer.input_layernorm.weight": ((H,), "BF16"),
        "midlayer.hidden_norm.weight": ((H,), "BF16"),
        "midlayer.post_attention_layernorm.weight": ((H,), "BF16"),
        "midlayer.self_attn.q_proj.weight": ((64, 2 * H), "BF16"),
        "midlayer.self_attn.k_proj.weight": ((32, 2 * H), "BF16"),
        "midlayer.self_attn.v_proj.weight": ((32, 2 * H), "BF16"),
        "midlayer.self_attn.o_proj.weight": ((H, 64), "BF16"),
        "midlayer.mlp.gate_proj.weight": ((128, H), "BF16"),
        "midlayer.mlp.up_proj.weight": ((128, H), "BF16"),
        "midlayer.mlp.down_proj.weight": ((H, 128), "BF16"),
        "norm.weight": ((H,), "BF16"),
        "lm_head.weight": ((500, H), "BF16"),
        "d2t": ((500,), "I64"),
        "t2d": ((49152,), "BOOL"),
    }
    assert check_draft(out, tiny_llama_dir) == ([], [])
    # a draft checked against the wrong target fails loudly, naming the reason
    errors, _ = check_draft(out, "smollm2")
    assert any("another target" in e for e in errors)
    assert main(["check-draft", str(out), "--model", "smollm2"]) == 1
    # a tampered mapping is caught
    from safetensors.torch import load_file, save_file

    sd = load_file(str(out / "model.safetensors"))
    sd["t2d"][int(draft_ids_to_target(sd["d2t"])[0])] = False
    sd["embed_tokens.weight"] = torch.zeros(3, 3)
    save_file(sd, str(out / "model.safetensors"))
    errors, _ = check_draft(out, tiny_llama_dir)
    assert any("t2d" in e for e in errors) and any("embed_tokens" in e for e in errors)


def test_sigkill_at_several_points_then_resume_reproduces_losses(tiny_llama_dir, tiny_store, tmp_path):
    """`eaglenest train` killed with SIGKILL (no cleanup runs) at several moments -- mid-step, around
    checkpoint writes -- and re-run with --resume each time ends with the uninterrupted run's losses."""
    import signal
    import subprocess
    import sys
    import time

    full = tmp_path / "full"
    Trainer(cfg(tiny_llama_dir, tiny_store, full, max_steps=12)).fit()
    run = tmp_path / "killed"
    argv = [sys.executable, "-m", "eaglenest", "train", "--model", str(tiny_llama_dir), "--features", str(tiny_store),
            "--out", str(run), "--ttt-steps", "3", "--draft-vocab", "500", "--max-steps", "12", "--lr", "3e-3",
            "--batch-tokens", "256", "--grad-accum", "2", "--eval-fraction", "0.2", "--device", "cpu", "--save-every", "2"]
    log = run / "metrics.jsonl"
    kills = []
    for i, at_lines in enumerate((2, 5, 9)):  # kill once the log holds this many steps
        err = tmp_path / f"stderr-{i}.txt"
        with err.open("wb") as ef:
            p = subprocess.Popen(argv + (["--resume"] if i else []), stdout=subprocess.DEVNULL, stderr=ef)
        deadline = time.time() + 120
        while time.time() < deadline and p.poll() is None:
            if log.exists() and len(log.read_bytes().splitlines()) >= at_lines:
                break
            time.sleep(0.002)
        assert p.poll() is None, f"run {i} ended (exit {p.returncode}) before it could be killed: {err.read_text()[-2000:]}"
        p.send_signal(signal.SIGKILL)
        p.wait()
        latest = run / "checkpoints" / "latest.json"
        kills.append((len(log.read_bytes().splitlines()), json.loads(latest.read_text())["step"] if latest.exists() else 0))
    r = subprocess.run(argv + ["--resume"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    a, b = losses(full), losses(run)
    assert len(b) == 12 and [json.loads(x)["step"] for x in log.read_text().splitlines()] == list(range(1, 13))
    assert a == pytest.approx(b, rel=1e-6, abs=1e-7), kills
    assert kills[-1][1] >= 4, (kills, [(tmp_path / f"stderr-{i}.txt").read_text()[-1000:] for i in range(3)])  # the kills landed mid-run, after some checkpoints
    assert not list((run / "checkpoints").glob("*.partial"))  # a checkpoint torn by a kill is rewritten on resume
    print("kills (log lines, checkpoint step):", kills)


def test_cpu_memory_defaults_keep_user_choice_and_trim_runs():
    """`import eaglenest` caps oneDNN's kernel cache unless the user set it; the heap trim is callable
    (glibc) or a no-op, and never raises (git show 0c8d13e:bench/results/train_cpu_memory.json for why)."""
    import subprocess
    import sys

    code = "import os, eaglenest; from eaglenest.utils import release_free_heap; release_free_heap(); release_free_heap(); print(os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'])"
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.strip() == "64"
    env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = "7"
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.strip() == "7"


def test_a_run_with_checkpoints_is_not_overwritten_without_resume_or_overwrite(tiny_llama_dir, tiny_store, tmp_path):
    """Issue 13: `train` into a run directory holding checkpoints used to truncate its metrics and
    overwrite its checkpoints.  Now it refuses before touching anything; --overwrite starts over."""
    from eaglenest.cli import main

    run = tmp_path / "run"
    Trainer(cfg(tiny_llama_dir, tiny_store, run, max_steps=3, save_every=1)).fit()
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(EaglenestError, match="holds checkpoints up to step-00000003.*--resume.*--overwrite"):
        Trainer(cfg(tiny_llama_dir, tiny_store, run, max_steps=5))
    argv = ["train", "--model", str(tiny_llama_dir), "--features", str(tiny_store), "--out", str(run), "--device", "cpu"]
    assert main(argv) == 2  # the CLI: one-line error, exit 2
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    Trainer(cfg(tiny_llama_dir, tiny_store, run, max_steps=2, overwrite=True)).fit()
    assert len(losses(run)) == 2 and sorted(d.name for d in (run / "checkpoints").glob("step-*")) == ["step-00000002"]


@pytest.mark.parametrize("change,named", [
    (dict(batch_tokens=512), "train.batch_tokens: run 256, now 512"),
    (dict(grad_accum=1, seed=3), "train.grad_accum: run 2, now 1; train.seed: run 0, now 3"),
    (dict(ttt_steps=4), "train.ttt_steps"),
    (dict(draft_vocab=400), "train.draft_vocab: run 500, now 400"),
    (dict(max_len=32), "train.max_len"),
    (dict(fc_norm=True), "train.fc_norm: run False, now True"),
    (dict(norm_output=True), "train.norm_output: run False, now True"),
    (dict(draft_attention="mla"), "train.draft_attention: run 'gqa', now 'mla'"),
])
def test_resume_refuses_a_config_that_changes_data_order_or_model(tiny_llama_dir, tiny_store, tmp_path, change, named):
    run = tmp_path / "run"
    Trainer(cfg(tiny_llama_dir, tiny_store, run, max_steps=2, save_every=1)).fit()
    with pytest.raises(EaglenestError, match="--resume would change") as e:
        Trainer(cfg(tiny_llama_dir, tiny_store, run, resume=True, **change))
    assert named in str(e.value)
    # what does not change the order or the model may change: a longer run, another lr, eval cadence
    t = Trainer(cfg(tiny_llama_dir, tiny_store, run, resume=True, max_steps=4, lr=1e-3, eval_every=3))
    assert t.step == 2


def test_a_run_from_before_the_draft_kinds_resumes(tiny_llama_dir, tiny_store, tmp_path):
    """A run directory written before fc_norm / norm_output / draft_attention existed (none of them in
    its config.json) resumes as what it was, an EAGLE-3 GQA draft; asking it for fc_norm is refused."""
    run = tmp_path / "run"
    Trainer(cfg(tiny_llama_dir, tiny_store, run, max_steps=2, save_every=1)).fit()
    rc = json.loads((run / "config.json").read_text())
    new = ("fc_norm", "norm_output", "attention", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    for block in (rc["draft"], rc["identity"]["draft"]):
        for k in new:
            block.pop(k)
    for k in ("fc_norm", "norm_output", "draft_attention"):
        rc["train"].pop(k), rc["identity"]["train"].pop(k)
    (run / "config.json").write_text(json.dumps(rc))
    assert Trainer(cfg(tiny_llama_dir, tiny_store, run, resume=True, max_steps=3)).step == 2
    with pytest.raises(EaglenestError, match="draft.fc_norm: run False, now True"):
        Trainer(cfg(tiny_llama_dir, tiny_store, run, resume=True, fc_norm=True))


def test_resume_refuses_another_store(tiny_llama_dir, tiny_store, tmp_path):
    """The store's samples are part of the data order: a store with one sample less is refused."""
    import shutil

    run = tmp_path / "run"
    Trainer(cfg(tiny_llama_dir, tiny_store, run, max_steps=1)).fit()
    other = tmp_path / "feat2"
    shutil.copytree(tiny_store, other)
    from eaglenest.features import FeatureStore

    fs = FeatureStore(other)
    fs.drop({fs.ids()[0]})
    with pytest.raises(EaglenestError, match="store_fingerprint"):
        Trainer(cfg(tiny_llama_dir, other, run, resume=True))


def test_resume_loads_checkpoints_strictly(tiny_llama_dir, tiny_store, tmp_path):
    """A checkpoint missing a tensor (or holding an unknown one) is an error naming the keys, not
    a silently half-initialized draft (load_state_dict(strict=False) before)."""
    from safetensors.torch import load_file, save_file

    run = tmp_path / "run"
    Trainer(cfg(tiny_llama_dir, tiny_store, run, max_steps=1)).fit()
    f = run / "checkpoints" / "step-00000001" / "model.safetensors"
    sd = load_file(str(f))
    sd.pop("midlayer.mlp.up_proj.weight")
    sd["extra.weight"] = torch.zeros(2)
    save_file(sd, str(f))
    with pytest.raises(EaglenestError, match=r"missing \['midlayer.mlp.up_proj.weight'\], unexpected \['extra.weight'\]"):
        Trainer(cfg(tiny_llama_dir, tiny_store, run, resume=True, max_steps=2))


def test_tensorboard_mirrors_the_jsonl_and_is_closed(tiny_llama_dir, tiny_store, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    Trainer(cfg(tiny_llama_dir, tiny_store, run, max_steps=3, report_to="tensorboard")).fit()
    ev = EventAccumulator(str(run / "tb"))
    ev.Reload()
    assert [e.step for e in ev.Scalars("loss")] == [1, 2, 3]
    assert [e.value for e in ev.Scalars("loss")] == pytest.approx(losses(run), rel=1e-6)
    assert len(ev.Scalars("train_acc/2")) == 3


def test_prefetch_reads_the_next_step_while_this_one_computes(tiny_llama_dir, tiny_store, tmp_path):
    """Issue 15: the loop never waits on the store when the store is fast enough.  With a slowed
    reader, the read of step n+1 has begun before step n's optimizer step returns: step n's
    update waits (on an event, not a clock) until the reader has started on n+1, which can only
    happen if reading runs ahead of the loop.  Reads stay bounded and the losses are those of a
    run that reads in the loop (bit-identical)."""
    import threading
    import time

    events, lock = [], threading.Lock()
    started = {}

    def note(*e):
        with lock:
            events.append(e)

    def build(out, prefetch):
        t = Trainer(cfg(tiny_llama_dir, tiny_store, out, max_steps=6, prefetch=prefetch))
        src, step_fn = t.source, t.optimizer_step

        class SlowSource:
            def load(self, step):
                note("read", step)
                started.setdefault(step, threading.Event()).set()
                time.sleep(0.05)  # a slow disk
                return src.load(step)

            def load_batch(self, idx):
                return src.load_batch(idx)

        def step(data):
            out = step_fn(data)
            if data.step + 1 < t.total_steps and prefetch:
                assert started.setdefault(data.step + 1, threading.Event()).wait(60), f"step {data.step + 1} not read ahead"
            note("stepped", data.step)
            return out

        t.source, t.optimizer_step = SlowSource(), step
        return t

    build(tmp_path / "pre", prefetch=2).fit()
    order = list(events)
    for n in range(5):
        assert order.index(("read", n + 1)) < order.index(("stepped", n))
    ahead = max(sum(e[0] == "read" for e in order[: i + 1]) - sum(e[0] == "stepped" for e in order[: i + 1]) for i in range(len(order)))
    assert ahead <= 3  # depth 2: at most the current step and two more are read
    started.clear()
    build(tmp_path / "inline", prefetch=0).fit()
    assert losses(tmp_path / "pre") == losses(tmp_path / "inline")
