"""vLLM 0.32 (CPU) and the seed's target family.

* Our vLLM facts (export/layer_ids.py) against the installed vLLM: which target classes implement
  SupportsEagle3, and which layers its model runner reads from a draft config (its own method run
  on our configs).
* Live: vLLM captures the tiny DeepSeek-V3 (MLA + MoE) target's states on CPU, equal to HF's.
* Live: vLLM's EAGLE-3 loader takes a draft of the MLA default shape (head_dim = v_head_dim, which
  is not hidden / heads; KV heads = heads; Kimi-K2.5's YaRN rope; full vocabulary, so no d2t) and
  serves it with greedy output unchanged.  It is served next to a tiny Llama target with that rope:
  vLLM 0.32 on CPU cannot run an EAGLE-3 draft next to an MLA target ("No common block size for 16
  (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])", docs/vllm.md).
"""

from __future__ import annotations

import json
import subprocess

import pytest

from eaglenest.export.layer_ids import VLLM_EAGLE3_CLASSES, VLLM_NO_EAGLE3, engine_capture
from family_helpers import KIMI_K25_TEXT, tiny_deepseek
from vllm_helpers import compare_features, make_tiny_data, requires_vllm, vllm_python

pytestmark = [pytest.mark.vllm, requires_vllm]

CONFIGS = [  # draft configs as other trainers and we write them
    {},
    {"eagle_aux_hidden_state_layer_ids": [3, 10, 20]},
    {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 9, 19]}},
    {"eagle_aux_hidden_state_layer_ids": [3, 10, 20], "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 9, 19]}},
]

PROBE = r"""
import json, logging, sys
logging.disable(logging.CRITICAL)
from types import SimpleNamespace as NS
from transformers import PretrainedConfig
from vllm.model_executor.models.interfaces import supports_eagle3
from vllm.model_executor.models.registry import ModelRegistry
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
classes, configs = json.loads(sys.argv[1]), json.loads(sys.argv[2])
support = {c: bool(supports_eagle3(ModelRegistry._try_load_model_cls(c))) for c in classes}
read = []
for cfg in configs:
    me = NS(speculative_config=NS(draft_model_config=NS(hf_config=PretrainedConfig(**cfg))))
    ids = GPUModelRunner._get_eagle3_aux_layers_from_config(me)
    read.append(None if ids is None else list(ids))
print(json.dumps({"support": support, "read": read}))
"""


def test_vllm_facts_match_the_installed_vllm():
    classes = sorted(VLLM_EAGLE3_CLASSES | VLLM_NO_EAGLE3)
    r = subprocess.run([str(vllm_python()), "-c", PROBE, json.dumps(classes), json.dumps(CONFIGS)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["support"] == {c: c in VLLM_EAGLE3_CLASSES for c in classes}
    n = 30
    for cfg, ids in zip(CONFIGS, got["read"]):
        # absent ids: the model's default, which is [2, N//2, N-3] (interfaces.py)
        assert engine_capture("vllm", "LlamaForCausalLM", n, cfg) == (ids if ids is not None else [2, 15, 27]), cfg


@pytest.mark.slow
def test_vllm_captures_the_mla_target_like_hf(tmp_path, smollm2):
    from eaglenest.capture.run import run_capture
    from eaglenest.cli import main
    from eaglenest.data import PreparedData
    from eaglenest.engines.hf import HFEngine

    target = tiny_deepseek(tmp_path / "dsv3", smollm2)
    data = make_tiny_data(tmp_path / "data", str(target), n=4, max_length=96)
    log = tmp_path / "server.log"
    assert main(["capture", "--model", str(target), "--data", str(data), "--out", str(tmp_path / "vllm"), "--engine", "vllm",
                 "--vllm-serve", "--vllm-log", str(log), "--layers", "3,4,6"]) == 0, log.read_text()[-3000:]
    # what vLLM captured is checked against HF below, not how its log words the attention backend
    # (it differs per CPU: "MLA is enabled" here, "Using AMX_MLA backend" on an Intel Xeon with AMX)
    with HFEngine(str(target), layers="3,4,6", dtype="bf16", device="cpu") as e:
        run_capture(e, PreparedData(data), tmp_path / "hf", dtype="bf16")
    r = compare_features(tmp_path / "vllm", tmp_path / "hf", target, "bf16")
    print("MLA capture agreement:", json.dumps(r))
    assert r["ids_equal"] and r["samples"] == 4 and r["layer_ids"] == [3, 4, 6]
    for k in range(3):
        assert r["cos_mean"][k] >= 0.9995 and r["cos_min"][k] >= 0.99, r
    assert r["teacher_kl_mean"] <= 0.01 and r["teacher_argmax_agree"] >= 0.95, r


@pytest.mark.slow
def test_vllm_loads_and_serves_the_mla_default_draft_shape(tmp_path, smollm2):
    """The draft shape eaglenest picks for an MLA target -- head_dim (32) that is not hidden / heads
    (16), KV heads = heads, Kimi-K2.5's YaRN rope (factor 64, original 4096, theta 50000), the full
    vocabulary (no d2t) -- served by vLLM next to a tiny Llama target carrying the same rope (vLLM's
    CPU attention takes head_dim 32, not the tiny test Llama's 16)."""
    import torch
    from helpers_eval import eval_args
    from safetensors import safe_open
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from eaglenest.capture.layers import default_layer_ids
    from eaglenest.draft.model import Eagle3Config, Eagle3Draft
    from eaglenest.evaluate.run import evaluate
    from eaglenest.export.format import save_draft
    from eaglenest.models.target import load_config

    rope = {"rope_type": "yarn", "rope_theta": 50000.0,
            **{k: v for k, v in KIMI_K25_TEXT["rope_scaling"].items() if k != "type"}}
    target = tmp_path / "llama_yarn"
    torch.manual_seed(0)
    tcfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=32, vocab_size=49152, max_position_embeddings=262144, rms_norm_eps=1e-5, rope_parameters=rope,
                       tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    LlamaForCausalLM(tcfg).save_pretrained(target)
    AutoTokenizer.from_pretrained(smollm2).save_pretrained(target)
    mla_defaults = {"num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 32}  # as draft/shape.py picks for MLA
    cfg = Eagle3Config.from_target(load_config(target), 49152, default_layer_ids(8), shape=mla_defaults)
    assert (cfg.head_dim * cfg.num_attention_heads, cfg.hidden_size, cfg.rope_parameters["factor"]) == (128, 64, 64.0)
    d = Eagle3Draft(cfg)
    for m in d.modules():
        if isinstance(m, torch.nn.Linear):
            torch.nn.init.normal_(m.weight, std=0.02)
    draft = save_draft(d, tmp_path / "draft")
    with safe_open(str(draft / "model.safetensors"), "pt") as f:
        assert not {"d2t", "t2d"} & set(f.keys())  # a full vocabulary: vLLM has no parameter for a d2t
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"question_id": "q1", "prompt": "Write a haiku about the sea."}) + "\n")
    a = eval_args(target, draft, bench, tmp_path / "r.json", "vllm", steps=3, max_new_tokens=24, device="cpu", dtype="bf16",
                  engine_args={"log_dir": str(tmp_path / "logs")})
    r = evaluate(a)
    # served as a draft (verify steps with drafted tokens) and greedy unchanged: what was served, not the log's wording
    assert r["greedy_matches_baseline"] is True and r["verify_steps"] > 0, r.get("greedy_mismatches")
    assert r["n_generations"] == 1 and r["tau"] is not None and r["tau"] >= 1.0
