"""DFlash through the shared trainer, export and check-draft, on the tiny random target's store:
resume == uninterrupted, the per-slot metrics, the exact checkpoint contract vLLM 0.32 loads
(config keys, tensor names and shapes), check-draft per engine, and the loaded draft == the trained one."""

import json

import pytest
import torch
from safetensors import safe_open
from test_train import cfg, keep_only_step3, losses, tiny_store  # noqa: F401 -- the shared tiny store fixture

from eaglenest import EaglenestError
from eaglenest.train.trainer import TrainConfig, Trainer

BLOCK = 4


def dcfg(tiny_llama_dir, store, out, **kw):
    base = dict(draft_kind="dflash", block_size=BLOCK, draft_layers=2, dflash_anchors=6, grad_accum=2)
    base.update(kw)
    return cfg(tiny_llama_dir, store, out, **base)


def test_dflash_resume_reproduces_uninterrupted_run(tiny_llama_dir, tiny_store, tmp_path):  # noqa: F811
    full = tmp_path / "full"
    res = Trainer(dcfg(tiny_llama_dir, tiny_store, full, max_steps=8)).fit()
    part = tmp_path / "part"
    Trainer(dcfg(tiny_llama_dir, tiny_store, part, max_steps=8, save_every=3)).fit()
    keep_only_step3(part)
    Trainer(dcfg(tiny_llama_dir, tiny_store, part, max_steps=8, resume=True)).fit()
    a, b = losses(full), losses(part)
    assert len(a) == 8 and a == pytest.approx(b, rel=1e-6, abs=1e-7)
    assert len({round(x, 6) for x in a}) > 4
    rows = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()]
    assert len(rows[0]["train_acc"]) == BLOCK - 1 and len(rows[-1]["eval_expected_tau"]) == BLOCK - 1
    assert res["eval"] is not None and all(c >= 0 for c in res["eval"]["acc"])
    rc = json.loads((full / "config.json").read_text())
    assert rc["draft"]["kind"] == "dflash" and rc["draft"]["num_hidden_layers"] == 2 and rc["draft"]["mask_token_id"] == 16
    # anchors depend on the step: another seed draws other anchors, so other losses
    other = tmp_path / "other"
    Trainer(dcfg(tiny_llama_dir, tiny_store, other, max_steps=2, seed=1)).fit()
    assert losses(other)[:2] != pytest.approx(a[:2])
    with pytest.raises(EaglenestError, match="dflash_anchors"):  # a resume may not change the anchors drawn
        Trainer(dcfg(tiny_llama_dir, tiny_store, part, max_steps=8, resume=True, dflash_anchors=7))


def test_dflash_starts_at_a_uniform_guess(tiny_llama_dir, tiny_store, tmp_path):  # noqa: F811
    """Issue 42: the start is a zero head (every logit 0: the first loss is ln(draft vocabulary), not the
    ~100 nats the target's head gave the mask slots) with a fresh final norm and q/k norms at
    --dflash-qk-gain; --init-head target keeps the target's rows for who wants them."""
    import math

    t = Trainer(dcfg(tiny_llama_dir, tiny_store, tmp_path / "r", max_steps=1, eval_fraction=0.0))
    m = t.model
    assert not m.lm_head.weight.any() and torch.equal(m.norm.weight, torch.ones_like(m.norm.weight))
    assert all(float(x.self_attn.q_norm.weight.min()) == float(x.self_attn.k_norm.weight.max()) == 2.0 for x in m.layers)
    t.fit()
    first = json.loads((tmp_path / "r" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["loss"] == pytest.approx(math.log(500), abs=1e-5) and first["train_loss"] == pytest.approx([math.log(500)] * (BLOCK - 1), abs=1e-5)
    old = Trainer(dcfg(tiny_llama_dir, tiny_store, tmp_path / "o", max_steps=1, init_head="target", dflash_qk_gain=1.0))
    assert old.model.lm_head.weight.any() and float(old.model.layers[0].self_attn.q_norm.weight.max()) == 1.0
    with pytest.raises(EaglenestError, match="freeze-head"):  # auto = zero for DFlash: nothing to freeze
        dcfg(tiny_llama_dir, tiny_store, tmp_path / "f", freeze_head=True).validate()


def test_dflash_learns(tiny_llama_dir, tiny_store, tmp_path):  # noqa: F811
    """The tiny store's tokens are random (nothing to generalize): the draft memorizes its training blocks."""
    Trainer(dcfg(tiny_llama_dir, tiny_store, tmp_path / "r", max_steps=60, grad_accum=1, lr=1e-2, eval_fraction=0.0)).fit()
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    first, last = [sum(r["train_loss"][0] for r in part) / len(part) for part in (rows[:5], rows[-5:])]
    assert last < 0.9 * first, (first, last)


def test_dflash_export_contract_check_draft_and_load(tiny_llama_dir, tiny_store, tmp_path):  # noqa: F811
    from eaglenest.cli import main
    from eaglenest.export.check import check_draft, judge_draft
    from eaglenest.export.format import load_draft

    run = tmp_path / "run"
    t = Trainer(dcfg(tiny_llama_dir, tiny_store, run, max_steps=2))
    t.fit()
    out = tmp_path / "draft"
    assert main(["export", "--run", str(run), "--out", str(out)]) == 0  # checked for vLLM and our decoder
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "sg"), "--engine", "sglang"]) == 2  # refused: SGLang's head
    c = json.loads((out / "config.json").read_text())
    assert c["architectures"] == ["DFlashDraftModel"] and c["model_type"] == "qwen3"
    assert c["num_hidden_layers"] == 2 and c["block_size"] == BLOCK and c["num_target_layers"] == 8
    # the store's capture-before [2, 4, 5] -> output-of ids: both engines capture before id + 1
    assert c["dflash_config"] == {"mask_token_id": 16, "target_layer_ids": [1, 3, 4], "causal": False, "use_swa": False}
    assert c["draft_vocab_size"] == 500 and c["target_hidden_size"] == 64 and "eagle_aux_hidden_state_layer_ids" not in c
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    H, q, kv, inter, hd = 64, 64, 32, 128, 16
    want = {"fc.weight": ((H, 3 * H), "BF16"), "hidden_norm.weight": ((H,), "BF16"), "norm.weight": ((H,), "BF16"),
            "lm_head.weight": ((500, H), "BF16"), "d2t": ((500,), "I64"), "t2d": ((49152,), "BOOL")}
    for i in range(2):
        p = f"layers.{i}."
        want.update({p + "input_layernorm.weight": ((H,), "BF16"), p + "post_attention_layernorm.weight": ((H,), "BF16"),
                     p + "self_attn.q_proj.weight": ((q, H), "BF16"), p + "self_attn.k_proj.weight": ((kv, H), "BF16"),
                     p + "self_attn.v_proj.weight": ((kv, H), "BF16"), p + "self_attn.o_proj.weight": ((H, q), "BF16"),
                     p + "self_attn.q_norm.weight": ((hd,), "BF16"), p + "self_attn.k_norm.weight": ((hd,), "BF16"),
                     p + "mlp.gate_proj.weight": ((inter, H), "BF16"), p + "mlp.up_proj.weight": ((inter, H), "BF16"),
                     p + "mlp.down_proj.weight": ((H, inter), "BF16")})
    assert keys == want
    errors, warnings = check_draft(out, tiny_llama_dir, engines=("vllm", "hf"))
    assert errors == []
    r = judge_draft(out, tiny_llama_dir)
    assert any("target's lm_head" in e for e in r.errors(("sglang",)))  # SGLang would not use the trained head
    assert any("GPU only" in n for n in r.notes)
    # the loaded draft computes what the trained one does (bf16 weights)
    d = load_draft(out, embed_weight=t.model.embed_tokens)
    assert d.cfg.kind == "dflash" and d.cfg.aux_layer_ids == [2, 4, 5]
    ref = t.model
    with torch.no_grad():  # the exported weights are bf16; the embeddings (not exported) stay the target's
        for p in ref.parameters():
            p.copy_(p.bfloat16().float())
    aux = torch.randn(1, 12, 3 * H)
    a = torch.tensor([[3, 9]])
    assert torch.allclose(d(aux, torch.tensor([[5, 6]]), a), ref(aux, torch.tensor([[5, 6]]), a), atol=1e-5)
    # a tampered config: another mask token outside the vocabulary, layers the draft was not trained on
    c["dflash_config"]["mask_token_id"] = 10**6
    c["dflash_config"]["target_layer_ids"] = [1, 3, 5]
    (out / "config.json").write_text(json.dumps(c))
    errors, _ = check_draft(out, tiny_llama_dir, engines=("vllm",))
    assert any("mask_token_id" in e for e in errors) and any("trained on [2, 4, 5]" in e for e in errors)


def test_config_refusals(tiny_llama_dir, tmp_path):
    with pytest.raises(EaglenestError, match="one layer"):
        TrainConfig(model="m", features="f", out="o", draft_layers=2).validate()
    with pytest.raises(EaglenestError, match="block-size"):
        TrainConfig(model="m", features="f", out="o", draft_kind="dflash", block_size=1).validate()


def test_dflash_online_equals_offline_and_two_gloo_ranks_equal_one(tiny_llama_dir, tiny_store, tmp_path):  # noqa: F811
    """The trainer's --online path and torchrun are shared with EAGLE-3: an online DFlash run (hf
    engine, fp32, the store's layers) logs the offline run's losses; 2 gloo ranks log one process's;
    an online run without --layers captures DFlash's default layers."""
    import os
    import socket
    import subprocess
    import sys

    from test_online import write_data
    from test_train import fake_samples

    kw = dict(max_steps=4, eval_fraction=0.0)
    off = tmp_path / "off"
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        Trainer(dcfg(tiny_llama_dir, tiny_store, off, **kw)).fit()
        data = write_data(tmp_path / "data", fake_samples())  # the samples the tiny store was captured from
        on = tmp_path / "on"
        t = Trainer(dcfg(tiny_llama_dir, None, on, online=True, data=str(data), features=None, capture_dtype="fp32",
                         layers="2,4,5", **kw))
        t.fit()
        auto = Trainer(dcfg(tiny_llama_dir, None, tmp_path / "auto", online=True, data=str(data), features=None,
                            capture_dtype="fp32", max_steps=1, eval_fraction=0.0))
        assert auto.store.meta.layer_ids == [2, 3, 4, 5, 6]  # capture.layers.spread_layer_ids(8, 5)
        auto.close_engine()
    finally:
        torch.set_num_threads(n)
    assert losses(on) == pytest.approx(losses(off), rel=1e-5)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    two = tmp_path / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
           str(port), "-m", "eaglenest", "train", "--model", str(tiny_llama_dir), "--features", str(tiny_store), "--out", str(two),
           "--draft-kind", "dflash", "--block-size", str(BLOCK), "--draft-layers", "2", "--dflash-anchors", "6", "--draft-vocab", "500",
           "--max-steps", "4", "--lr", "3e-3", "--batch-tokens", "256", "--grad-accum", "2", "--eval-fraction", "0.0",
           "--device", "cpu"]
    r = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", "EAGLENEST_NO_PROGRESS": "1"}, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert losses(two) == pytest.approx(losses(off), rel=1e-5)
