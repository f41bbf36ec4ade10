"""The one home of target facts (models/target.py, models/families.py): stop ids (one rule), the
teacher's final norm and head per family (Llama w*x, Gemma (1+w) with logit soft-capping, a
multimodal checkpoint's prefixed names), decoder layers, the draft config from a target."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from eaglenest.models.target import decoder_layers, end_of_turn_id, eos_token_ids, target_facts
from eaglenest.models.weights import target_head
from eaglenest.train.ttt import Teacher

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_stop_ids_are_one_rule(tmp_path, smollm2):
    """config + generation_config eos, the tokenizer's eos, the template's end-of-turn token."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    tok.add_special_tokens({"additional_special_tokens": ["<|eot_id|>"]})
    tok.chat_template = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '<|eot_id|>' }}{% endfor %}"
    tok.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 7}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    assert end_of_turn_id(tok) == eot
    assert eos_token_ids(tmp_path) == [7, 9, tok.eos_token_id, eot]
    # SmolLM2: config, generation config, tokenizer and template all say <|im_end|>
    assert eos_token_ids(smollm2) == [2]


def test_gemma2_teacher_matches_the_model(tmp_path, smollm2):
    """A pre-norm final state (vLLM's) through the teacher = the model's own softmax: Gemma's (1 + w)
    final norm and its tanh logit soft-capping come from the family table, not a Llama guess."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, final_logit_softcapping=5.0, tie_word_embeddings=True)
    model = Gemma2ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.norm.weight.normal_(0, 0.5)  # non-zero, so (1 + w) and w differ
    model.save_pretrained(tmp_path)
    f = target_facts(tmp_path)
    assert (f.family.name, f.family.final_norm, f.logit_softcap, f.architecture) == ("gemma2", "rms_1p", 5.0, "Gemma2ForCausalLM")
    head = target_head(tmp_path)
    pre = {}
    model.model.norm.register_forward_pre_hook(lambda m, a: pre.setdefault("h", a[0]))
    ids = torch.randint(0, 1000, (1, 9))
    with torch.no_grad():
        logits = model(ids).logits[0]
    rows = torch.arange(0, 1000, 3)
    t2d = torch.zeros(1000, dtype=torch.bool)
    t2d[rows] = True
    teacher = Teacher(head["norm"].float(), head["norm_eps"], head["lm_head"].float(), rows, t2d, logit_softcap=head["logit_softcap"])
    r = teacher.targets(pre["h"][0], mass=True)
    probs, all_rows = r.probs(torch.arange(9)), torch.arange(9)
    torch.testing.assert_close(probs, torch.softmax(logits[:, rows], -1), atol=1e-5, rtol=1e-4)
    assert torch.equal(r.argmax, logits.argmax(-1))
    # the soft-capped full-vocabulary probability mass inside the draft vocabulary
    torch.testing.assert_close(r.log_mass, torch.log_softmax(logits, -1)[:, rows].logsumexp(-1), atol=1e-5, rtol=1e-4)
    # the Llama reading (w * x, no cap) would be wrong here: the test can fail
    wrong = Teacher(head["norm"].float() - 1.0, head["norm_eps"], head["lm_head"].float(), rows, t2d).targets(pre["h"][0]).probs(all_rows)
    assert not torch.allclose(wrong, probs, atol=1e-3)


def test_multimodal_checkpoint_names_and_text_config(tmp_path, dsv3_small):
    """Kimi-K2.5-style checkpoint: config with a deepseek_v3 `text_config`, tensors under `language_model.`."""
    src = json.loads((dsv3_small / "config.json").read_text())
    cfg = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"], "text_config": src}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    emb, norm, lm = torch.randn(49152, 64), torch.randn(64), torch.randn(49152, 64)
    save_file({"language_model.model.embed_tokens.weight": emb, "language_model.model.norm.weight": norm,
               "language_model.lm_head.weight": lm, "vision_tower.patch.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    f = target_facts(tmp_path)
    assert (f.family.name, f.architecture, f.num_layers, f.head_dim) == ("deepseek_v3", "KimiK25ForConditionalGeneration", 8, 32)
    h = target_head(tmp_path)
    assert torch.equal(h["embed"], emb) and torch.equal(h["norm"], norm) and torch.equal(h["lm_head"], lm)


def test_decoder_layers_of_a_deepseek_model(dsv3_small):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(dsv3_small)
    assert len(decoder_layers(m)) == 8 and type(decoder_layers(m)[0]).__name__ == "DeepseekV3DecoderLayer"


@pytest.fixture(scope="module")
def dsv3_small(tmp_path_factory, smollm2):
    from family_helpers import tiny_deepseek

    return tiny_deepseek(tmp_path_factory.mktemp("dsv3") / "t", smollm2)
