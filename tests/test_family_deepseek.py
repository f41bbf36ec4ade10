"""The seed's target family end to end: DeepSeek-V3 / Kimi-K2 (MLA + MoE) through prepare -> capture
-> train -> export -> check-draft -> eval, on a tiny random target built in-process from
transformers' own DeepseekV3ForCausalLM (8 layers, YaRN rope) with SmolLM2's tokenizer and real
ShareGPT conversations.  Checks: captured states equal HF hidden_states at the canonical and at
chosen layers; the exported ids make SGLang (DeepSeek rule) and vLLM capture exactly the trained
layers, or the export is refused with the reason; the draft's shape follows the MLA defaults."""

from __future__ import annotations

import json

import pytest
import torch

from eaglenest import EaglenestError
from eaglenest.cli import main
from family_helpers import tiny_deepseek

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def dsv3(tmp_path_factory, smollm2):
    return tiny_deepseek(tmp_path_factory.mktemp("dsv3") / "target", smollm2)


@pytest.fixture(scope="module")
def ds_data(tmp_path_factory, dsv3):
    from eaglenest.data import prepare

    out = tmp_path_factory.mktemp("ds_data")
    prepare(model=str(dsv3), data=["sharegpt:40"], out=out, max_length=96, limit=8, verbose=False)
    return out


def _capture(target, data, out, layers):
    from eaglenest.capture.run import run_capture
    from eaglenest.data import PreparedData
    from eaglenest.engines.hf import HFEngine

    with HFEngine(str(target), layers=layers, dtype="fp32", device="cpu") as e:
        s = run_capture(e, PreparedData(data), out, dtype="fp32", batch_tokens=256)
    assert s.failed == 0
    return out


@pytest.fixture(scope="module")
def store_346(tmp_path_factory, dsv3, ds_data):
    return _capture(dsv3, ds_data, tmp_path_factory.mktemp("feat346"), "3,4,6")


@pytest.mark.parametrize("layers,ids", [("auto", [2, 4, 5]), ("3,4,6", [3, 4, 6])])
def test_capture_equals_hf_hidden_states(dsv3, ds_data, tmp_path, layers, ids):
    from transformers import AutoModelForCausalLM

    from eaglenest.data import PreparedData
    from eaglenest.features import FeatureStore

    fs = FeatureStore(_capture(dsv3, ds_data, tmp_path / "feat", layers))
    assert fs.meta.layer_ids == ids and fs.meta.final_norm == "post"
    model = AutoModelForCausalLM.from_pretrained(dsv3, dtype=torch.float32).eval()
    by_id = {s.id: s for s in PreparedData(ds_data)}
    H = 64
    for i in range(len(fs)):
        x = fs[i]
        with torch.no_grad():
            hs = model(torch.tensor([by_id[x["id"]].input_ids]), output_hidden_states=True).hidden_states
        for j, k in enumerate(ids):
            got = x["aux_hidden_states"][:, j * H : (j + 1) * H].float()
            torch.testing.assert_close(got, hs[k][0], atol=2e-5, rtol=2e-5)  # fp32: the same tensor, up to padding
            assert not torch.allclose(got, hs[k + 1][0], atol=1e-3)  # and not the next layer's
        torch.testing.assert_close(x["last_hidden_state"].float(), hs[-1][0], atol=2e-5, rtol=2e-5)


def test_pipeline_on_chosen_layers(dsv3, store_346, tmp_path, capsys):
    """Train on layers 3,4,6 (capture-before), export, check-draft and eval."""
    from transformers import AutoConfig

    run, draft = tmp_path / "run", tmp_path / "draft"
    assert main(["train", "--model", str(dsv3), "--features", str(store_346), "--out", str(run), "--max-steps", "3",
                 "--ttt-steps", "2", "--draft-vocab", "1024", "--batch-tokens", "256", "--device", "cpu"]) == 0
    printed = capsys.readouterr().err
    assert "head_dim = 32  [deepseek_v3 (MLA)" in printed and "intermediate_size = 128" in printed
    assert main(["export", "--run", str(run), "--out", str(draft)]) == 0
    c = json.loads((draft / "config.json").read_text())
    # SGLang's DeepSeek rule takes ids as given unless the first is 1; vLLM reads the top-level ids
    assert c["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [3, 4, 6]}
    assert c["eagle_aux_hidden_state_layer_ids"] == [3, 4, 6]
    # MLA defaults: heads from the target, head_dim = v_head_dim, KV heads = heads, 12/7 x hidden MLP
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["intermediate_size"]) == (4, 4, 32, 128)
    tgt = json.loads((dsv3 / "config.json").read_text())
    assert c["rope_parameters"] == {k: v for k, v in tgt["rope_parameters"].items() if k != "type"}
    assert c["max_position_embeddings"] == tgt["max_position_embeddings"]
    loaded = AutoConfig.from_pretrained(draft)  # what both engines parse the draft config with
    assert loaded.rope_parameters["rope_type"] == "yarn" and loaded.rope_parameters["factor"] == 4.0
    assert loaded.head_dim == 32
    capsys.readouterr()
    assert main(["check-draft", str(draft), "--model", str(dsv3)]) == 0
    out = capsys.readouterr().out
    assert "sglang OK, vllm OK, hf OK" in out and "trained on layers [3, 4, 6]" in out

    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"question_id": 1, "turns": ["Name a color."]}) + "\n" + json.dumps({"question_id": 2, "turns": ["Count to three."]}) + "\n")
    report = tmp_path / "report.json"
    assert main(["eval", "--model", str(dsv3), "--draft", str(draft), "--out", str(report), "--bench", str(bench),
                 "--device", "cpu", "--dtype", "fp32", "--max-new-tokens", "8"]) == 0
    r = json.loads(report.read_text())
    assert r["greedy_matches_baseline"] is True and r["tau"] >= 1.0 and r["n_prompts"] == 2


def test_first_layer_one_cannot_be_served_by_sglang(dsv3, ds_data, tmp_path, capsys):
    """Trained on [1, 4, 6]: SGLang 0.5.23's DeepSeek class adds +1 exactly when the first id is 1, so
    no eagle_config makes it capture before layer 1: export refuses with the reason; a vLLM-only
    export works, and check-draft says what SGLang would do."""
    store = _capture(dsv3, ds_data, tmp_path / "feat", "1,4,6")
    run = tmp_path / "run"
    assert main(["train", "--model", str(dsv3), "--features", str(store), "--out", str(run), "--max-steps", "1",
                 "--ttt-steps", "1", "--draft-vocab", "512", "--batch-tokens", "256", "--device", "cpu"]) == 0
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "both")]) == 2
    err = capsys.readouterr().err
    assert "cannot be served on SGLang" in err and "w+1 if w[0] == 1" in err
    assert not (tmp_path / "both" / "config.json").exists()
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "vllm"), "--engine", "vllm"]) == 0
    c = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert c["eagle_aux_hidden_state_layer_ids"] == [1, 4, 6] and "eagle_config" not in c
    capsys.readouterr()
    assert main(["check-draft", str(tmp_path / "vllm"), "--model", str(dsv3), "--engine", "vllm"]) == 0
    assert main(["check-draft", str(tmp_path / "vllm"), "--model", str(dsv3)]) == 1
    out = capsys.readouterr().out
    assert "sglang: would capture before layers [2, 4, 5], the draft was trained on [1, 4, 6]" in out


def test_kimi_k2_and_deepseek_v2_targets(tmp_path, smollm2):
    """Kimi-K2 ships model_type `kimi_k2` (remote code): loaded as DeepSeek-V3 without trusting remote
    code; DeepSeek-V2 (no q_lora) captures and gets the MLA draft shape too."""
    from eaglenest.draft.model import Eagle3Config
    from eaglenest.engines.base import Request
    from eaglenest.engines.hf import HFEngine
    from eaglenest.models.target import load_config, target_facts

    for mt in ("kimi_k2", "deepseek_v2"):
        d = tiny_deepseek(tmp_path / mt, smollm2, model_type=mt, layers=7)
        f = target_facts(d)
        assert f.family.name == mt and f.family.attention == "mla" and f.num_layers == 7
        with HFEngine(str(d), layers="auto", dtype="fp32", device="cpu") as e:
            (cap,) = e.capture([Request("x", [1, 5, 9, 200, 3000])])
        assert e.layer_ids == [2, 3, 4] and cap.aux_hidden_states.shape == (5, 3 * 64)
        cfg = Eagle3Config.from_target(load_config(d), 256, [2, 3, 4])
        assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 4, 32)
    with pytest.raises(EaglenestError, match="not a known family"):
        target_facts({"model_type": "made_up", "hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 4, "vocab_size": 9})


def _tiny_qwen3_moe():
    """A random Qwen3-MoE (4 layers, the fewest EAGLE-3 takes; 8 experts, every layer sparse), built in-process."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, moe_intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=2048, tie_word_embeddings=False))


MOE_CLASSES = ("DeepseekV3MoE", "Qwen3MoeSparseMoeBlock")


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_moe_blocks_verify_token_by_token_and_speculative_equals_plain(family, dsv3, monkeypatch):
    """Exact verification on an MoE target (fp32).  The experts are 3-D weights that the MoE block
    calls through F.linear on the tokens routed to each expert together, which no Linear-module fix
    reaches.  With the experts' batched calls made row-count dependent in-process (as some blocked
    GEMMs are), the end-to-end probe sees a verification forward differ from plain decoding unless
    the blocks run token by token (rowwise/moe.py); with them it is bit-identical, and greedy
    speculative decoding equals plain greedy decoding (a random and an oracle draft)."""
    from helpers_eval import batch_dependent_linear, diversify, oracle_chain, plain_greedy, random_draft
    from transformers import AutoModelForCausalLM

    from eaglenest.evaluate import verification
    from eaglenest.evaluate.rowwise.moe import moe_blocks, set_block_rowwise
    from eaglenest.evaluate.specdec import SpecDecoder

    m = AutoModelForCausalLM.from_pretrained(dsv3, dtype=torch.float32) if family == "deepseek_v3" else _tiny_qwen3_moe()
    m = diversify(m).eval().requires_grad_(False)  # varied greedy outputs
    expected = {n for n, b in m.named_modules() if type(b).__name__ in MOE_CLASSES}
    assert expected, "the family's MoE class is not named in MOE_CLASSES"
    block = m.get_submodule(sorted(expected)[0])
    expert_shape = tuple(block.experts.gate_up_proj.shape[1:])
    assert expert_shape not in {shape for shape, *_ in verification.linear_groups(m)}  # no Linear module shares it
    monkeypatch.setattr(torch.nn.functional, "linear", batch_dependent_linear(expert_shape))

    v = verification.prepare(m, rows=4)
    blocks = moe_blocks(m)
    assert set(blocks) == expected and v["rowwise"]["moe_blocks"]["modules"] == len(blocks)
    assert f"MoE blocks token by token ({len(blocks)})" in verification.summary(v)
    assert v["probe_result"]["end_to_end"][0]["exact"] is True, v["probe_result"]["end_to_end"]
    x = torch.randn(1, 4, m.config.hidden_size)
    assert torch.equal(block(x), torch.cat([block(x[:, i : i + 1]) for i in range(4)], dim=1))

    for b in blocks.values():  # the blocks as transformers runs them: the probe catches the difference
        set_block_rowwise(b, None)
    assert not verification.probe_end_to_end(m, 4)["exact"]
    for b in blocks.values():
        set_block_rowwise(b, 4)
    assert verification.probe_end_to_end(m, 4)["exact"]

    d = random_draft(m, draft_vocab=4096, **({"attention": "mla"} if family == "deepseek_v3" else {}))
    for p in ([1, 500, 600, 700, 800], [1, 9690, 198, 2683, 359, 253]):
        ref = plain_greedy(m, p, 16)
        assert len(set(ref)) > 2, ref  # a target that repeats one token would hide a wrong cache
        with SpecDecoder(m, d, set(), steps=3) as sd:
            assert sd.generate(p, 16).output_ids == ref
            sd.propose = oracle_chain(p + ref, len(p), 3).__get__(sd)
            r = sd.generate(p, 16)
            assert r.output_ids == ref and r.tau > 3
