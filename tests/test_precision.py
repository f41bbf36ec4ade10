"""bf16 training with fp32 master weights (train/precision.py): the model runs in bf16, gradients
accumulate in fp32 masters over micro-batches, checkpoints hold the masters, a resumed bf16 run
continues exactly, and the trained draft is the fp32-parameter autocast run's to bf16 precision."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from test_train import cfg, keep_only_step3, losses, tiny_store  # noqa: F401 -- the module's store fixture

from eaglenest.draft.model import Eagle3Config, Eagle3Draft
from eaglenest.train.precision import MasterWeights
from eaglenest.train.trainer import Trainer


def small_draft():
    c = Eagle3Config(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=8, vocab_size=50,
                    draft_vocab_size=20, target_hidden_size=16, aux_layer_ids=[1, 2, 3], target_num_layers=4)
    torch.manual_seed(0)
    d = Eagle3Draft(c, embed_weight=torch.randn(50, 16))
    d.lm_head.weight.requires_grad_(False)  # a frozen head: no master, still bf16 in the model, fp32 in checkpoints
    return d


def test_masters_accumulate_in_fp32_and_stand_in_for_the_model():
    d = small_draft()
    before = {k: v.clone() for k, v in d.state_dict().items()}
    m = MasterWeights(d)
    assert all(p.dtype == torch.bfloat16 for p in d.parameters()) and d.embed_tokens.dtype == torch.bfloat16
    assert d.rotary.inv_freq.dtype == torch.float32  # buffers other than the embeddings keep their dtype
    assert [p.dtype for p in m.params] == [torch.float32] * len(m.params) and "lm_head.weight" not in m.names
    for n, p in zip(m.names, m.params):
        assert torch.equal(p, before[n])  # the masters are the fp32 weights, not their bf16 rounding
    x = torch.randn(4, 48, dtype=torch.bfloat16)
    grads = []
    for _ in range(2):  # two micro-batches
        out = d.fc(x).float().pow(2).sum()
        grads.append(torch.autograd.grad(out, d.fc.weight, retain_graph=True)[0].float())
        out.backward()
    fc = m.params[m.names.index("fc.weight")]
    torch.testing.assert_close(fc.grad, grads[0] + grads[1], rtol=0, atol=0)  # each bf16 gradient added in fp32
    assert d.fc.weight.grad is None
    with torch.no_grad():
        fc.add_(1e-3)
    m.sync()
    assert torch.equal(d.fc.weight, fc.to(torch.bfloat16))
    sd = m.state_dict()
    assert all(v.dtype == torch.float32 for k, v in sd.items() if v.is_floating_point())
    assert torch.equal(sd["fc.weight"], fc) and "embed_tokens" not in m.exported_state_dict()
    other = MasterWeights(small_draft())
    other.load_state_dict(sd)
    assert torch.equal(other.params[other.names.index("fc.weight")], fc) and torch.equal(other.model.fc.weight, d.fc.weight)


def test_bf16_run_checkpoints_masters_and_resumes_exactly(tiny_llama_dir, tiny_store, tmp_path):  # noqa: F811
    full = tmp_path / "full"
    t = Trainer(cfg(tiny_llama_dir, tiny_store, full, dtype="bf16"))
    assert t.masters is not None and next(t.model.parameters()).dtype == torch.bfloat16
    assert isinstance(t.opt, torch.optim.AdamW) and t.opt.defaults["fused"]
    t.fit()
    final = json.loads((full / "final.json").read_text())["checkpoint"]
    w = load_file(f"{final}/model.safetensors")
    masters = dict(zip(t.masters.names, t.masters.params))
    for k, v in w.items():
        if k in masters:
            assert v.dtype == torch.float32 and torch.equal(v, masters[k].detach()), k
    part = tmp_path / "part"
    Trainer(cfg(tiny_llama_dir, tiny_store, part, dtype="bf16", save_every=3)).fit()
    keep_only_step3(part)
    Trainer(cfg(tiny_llama_dir, tiny_store, part, dtype="bf16", resume=True)).fit()
    assert losses(full) == pytest.approx(losses(part), rel=1e-6, abs=1e-7)


def test_bf16_parameters_train_like_fp32_parameters_under_autocast(tiny_llama_dir, tiny_store, tmp_path, monkeypatch):  # noqa: F811
    """The same run with fp32 parameters under bf16 autocast (the previous bf16 training): the losses
    agree to bf16 precision at every step, and so do the trained weights, which moved far more than
    the two runs differ."""
    import eaglenest.train.trainer as trainer_mod

    def run(name):
        t = Trainer(cfg(tiny_llama_dir, tiny_store, tmp_path / name, dtype="bf16", max_steps=12, save_every=100))
        init = {k: v.float().clone() for k, v in (t.masters or t.model).state_dict().items()}
        t.fit()
        final = json.loads((tmp_path / name / "final.json").read_text())["checkpoint"]
        return t, losses(tmp_path / name), init, load_file(f"{final}/model.safetensors")

    t, a, init, wa = run("masters")
    assert t.masters is not None
    monkeypatch.setattr(trainer_mod, "MasterWeights", lambda model: None)
    t, b, _, wb = run("autocast")
    assert t.masters is None and next(t.model.parameters()).dtype == torch.float32
    assert len({round(x, 3) for x in a}) > 6  # the losses vary: the comparison is not vacuous
    assert a == pytest.approx(b, rel=1e-3)
    for k in ("fc.weight", "midlayer.mlp.down_proj.weight", "lm_head.weight", "norm.weight"):
        moved, apart = (wa[k] - init[k]).norm(), (wa[k] - wb[k]).norm()
        assert apart < 0.05 * moved, (k, float(apart), float(moved))
