"""Drafts written by other trainers' own published code (not files shaped by our exporter):
check-draft and eval accept what the engines accept and judge it per engine.

* SpecForge 0.2.0: `specforge.modeling.draft.llama3_eagle.LlamaForCausalLMEagle3` (attention_backend
  "sdpa", on CPU), its vocabulary mapping from `specforge.data.preprocessing`, its `load_embedding`
  of the target; `save_pretrained` writes `embed_tokens.weight` and no `target_hidden_size`.
* speculators 0.9.0: `Eagle3DraftModel` + `Eagle3SpeculatorConfig` (`layers.0.*`,
  `transformer_layer_config`, `norm_before_residual`), vLLM-only.
The target is the real SmolLM2; the foreign code runs in a subprocess with its wheel (installed
without dependencies into the eaglenest cache, see tests/foreign.py).
"""

from __future__ import annotations

import json
from collections import Counter
from types import SimpleNamespace as NS

import pytest
import torch

from eaglenest.cli import main
from foreign import DATASETS_DEPS, SPECFORGE_VERSION, SPECULATORS_IMPORT_DEPS, SPECULATORS_VERSION, run_python, site_with

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

SPECFORGE = r"""
import json, sys, torch
from collections import Counter
from transformers import AutoConfig, LlamaConfig
from specforge.data.preprocessing import process_token_dict_to_mappings
from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
target, out, counts, eagle_ids, embed = sys.argv[1:6]
t = AutoConfig.from_pretrained(target)
cfg = LlamaConfig(hidden_size=t.hidden_size, intermediate_size=t.intermediate_size, num_attention_heads=t.num_attention_heads,
    num_key_value_heads=t.num_key_value_heads, head_dim=t.head_dim, vocab_size=t.vocab_size, rms_norm_eps=t.rms_norm_eps,
    max_position_embeddings=t.max_position_embeddings, rope_parameters=dict(t.rope_parameters), num_hidden_layers=1,
    tie_word_embeddings=False, pad_token_id=None)
cfg.draft_vocab_size = 2048
cfg.architectures = ["LlamaForCausalLMEagle3"]
if eagle_ids != "none":
    cfg.eagle_config = {"eagle_aux_hidden_state_layer_ids": json.loads(eagle_ids)}
torch.manual_seed(0)
m = LlamaForCausalLMEagle3(cfg, attention_backend="sdpa")
token_dict = Counter({int(k): v for k, v in json.load(open(counts)).items()})
d2t, t2d = process_token_dict_to_mappings(token_dict, 2048, t.vocab_size)
torch.save({"d2t": d2t, "t2d": t2d}, out + ".vocab.pt")
m.load_vocab_mapping(out + ".vocab.pt")
if embed == "target":
    m.load_embedding(target)
m.save_pretrained(out)
# the draft's own step-0 logits on fixed inputs, for the equivalence check
g = torch.Generator().manual_seed(1)
ids = torch.randint(0, t.vocab_size, (1, 12), generator=g)
aux = torch.randn(1, 12, 3 * t.hidden_size, generator=g)
with torch.no_grad():
    h = m(hidden_states=aux, inputs_embeds=m.embed_input_ids(ids), ttt_length=1)  # returns norm(h)
    logits = m.lm_head(h)
torch.save({"ids": ids, "aux": aux, "logits": logits}, out + ".probe.pt")
"""

SPECULATORS = r"""
import sys, torch
from transformers import AutoConfig, LlamaConfig
from speculators import SpeculatorsConfig, VerifierConfig
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
target, out = sys.argv[1:3]
t = AutoConfig.from_pretrained(target)
layer = LlamaConfig(hidden_size=t.hidden_size, intermediate_size=t.intermediate_size, num_attention_heads=t.num_attention_heads,
    num_key_value_heads=t.num_key_value_heads, head_dim=t.head_dim, vocab_size=t.vocab_size, rms_norm_eps=t.rms_norm_eps,
    max_position_embeddings=t.max_position_embeddings, rope_parameters=dict(t.rope_parameters), num_hidden_layers=1,
    tie_word_embeddings=False)
cfg = Eagle3SpeculatorConfig(transformer_layer_config=layer, draft_vocab_size=2048, norm_before_residual=True,
    speculators_config=SpeculatorsConfig(algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
        default_proposal_method="greedy", verifier=VerifierConfig.from_pretrained(target)))
torch.manual_seed(0)
m = Eagle3DraftModel(cfg)
keep = torch.arange(0, t.vocab_size, t.vocab_size // 2048)[:2048]
t2d = torch.zeros(t.vocab_size, dtype=torch.bool)
t2d[keep] = True
m.load_vocab_mappings(t2d, keep - torch.arange(2048))
m.load_verifier_weights()  # embed_tokens and the draft rows of lm_head from the target
for mod in m.layers.modules():
    if isinstance(mod, torch.nn.Linear):
        torch.nn.init.normal_(mod.weight, std=0.02, generator=torch.Generator().manual_seed(2))
m.save_pretrained(out)
"""


@pytest.fixture(scope="module")
def token_counts(smol_data, tmp_path_factory):
    """Assistant-token frequencies of real prepared ShareGPT data (what SpecForge builds its vocabulary from)."""
    from eaglenest.data import PreparedData

    c = Counter()
    for s in PreparedData(smol_data):
        c.update(t for t, m in zip(s.input_ids, s.loss_mask) if m)
    p = tmp_path_factory.mktemp("counts") / "counts.json"
    p.write_text(json.dumps(c))
    return p


@pytest.fixture(scope="module")
def specforge(tmp_path_factory, smollm2, token_counts):
    site = site_with("specforge", SPECFORGE_VERSION, DATASETS_DEPS)  # specforge.data imports datasets

    def make(name: str, eagle_ids="none", embed="target"):
        out = tmp_path_factory.mktemp("specforge") / name
        run_python(SPECFORGE, site, args=[str(smollm2), str(out), str(token_counts), eagle_ids, embed])
        return out

    return make


def _check(draft, *extra, capsys) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["check-draft", str(draft), "--model", "smollm2", *extra])
    return rc, capsys.readouterr().out


def test_specforge_draft_is_accepted_and_read_as_specforge_computes_it(specforge, smollm2, capsys):
    from eaglenest.export.format import load_draft
    from eaglenest.models.weights import target_head

    draft = specforge("canonical")
    raw = json.loads((draft / "config.json").read_text())
    assert "target_hidden_size" not in raw and "eagle_config" not in raw
    rc, out = _check(draft, capsys=capsys)
    assert rc == 0, out
    assert "sglang OK, vllm OK, hf OK" in out and "embed_tokens.weight equals the target's" in out
    # our decoder computes exactly what SpecForge's own module computes from that file
    probe = torch.load(str(draft) + ".probe.pt", weights_only=True)
    embed = target_head(smollm2)["embed"].float()
    ours = load_draft(draft, embed_weight=embed, target_config=NS(num_hidden_layers=30))
    with torch.no_grad():
        logits = ours(probe["ids"], probe["aux"])
    torch.testing.assert_close(logits, probe["logits"], atol=1e-4, rtol=1e-4)


def test_specforge_output_of_ids_and_foreign_embeddings_are_judged_per_engine(specforge, capsys):
    # SpecForge run with layers 2,14,25 in its (output-of) convention: trained on capture-before 3,15,26
    draft = specforge("layers", eagle_ids="[2, 14, 25]")
    rc, out = _check(draft, capsys=capsys)
    assert rc == 1
    assert "trained on layers [3, 15, 26]" in out
    assert "vllm: would capture before layers [2, 14, 25], the draft was trained on [3, 15, 26]" in out
    assert "sglang OK, vllm NO, hf OK" in out
    assert _check(draft, "--engine", "sglang", "--engine", "hf", capsys=capsys)[0] == 0
    # an embed_tokens that is not the target's (SpecForge without load_embedding): vLLM uses it, SGLang does not
    rc, out = _check(specforge("own_embed", embed="random"), capsys=capsys)
    assert rc == 1 and "vllm: embed_tokens.weight differs from the target's" in out
    assert "sglang OK, vllm NO, hf OK" in out


def test_specforge_draft_evaluates(specforge, smollm2, tmp_path):
    draft = specforge("for_eval")
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"question_id": 1, "turns": ["What is the capital of France?"]}) + "\n")
    report = tmp_path / "r.json"
    assert main(["eval", "--model", "smollm2", "--draft", str(draft), "--out", str(report), "--bench", str(bench),
                 "--device", "cpu", "--max-new-tokens", "12"]) == 0
    r = json.loads(report.read_text())
    assert r["greedy_matches_baseline"] is True and r["tau"] >= 1.0


def test_speculators_draft_is_vllm_only_and_evaluates(tmp_path, smollm2, capsys):
    from eaglenest.export.format import load_draft
    from eaglenest.models.weights import target_head

    site = site_with("speculators", SPECULATORS_VERSION, SPECULATORS_IMPORT_DEPS)
    draft = tmp_path / "spec"
    run_python(SPECULATORS, site, args=[str(smollm2), str(draft)])
    rc, out = _check(draft, capsys=capsys)
    assert rc == 1 and "sglang NO, vllm OK, hf OK" in out
    assert "sglang: the speculators format: SGLang 0.5.23 has no loader for it" in out
    assert _check(draft, "--engine", "vllm", "--engine", "hf", capsys=capsys)[0] == 0
    d = load_draft(draft, embed_weight=target_head(smollm2)["embed"].float(), target_config=NS(num_hidden_layers=30))
    assert d.cfg.norm_before_residual and d.midlayer.norm_before_residual
    assert d.cfg.draft_vocab_size == 2048 and d.cfg.aux_layer_ids == [2, 15, 27]
