"""Tiny random targets of the seed's model family, built in-process from transformers' own classes
(shape and convention tests only; quality is measured on real models).

The DeepSeek-V3 one is MLA + MoE with 8 layers and YaRN rope, sized so that vLLM's CPU MLA backend
can run it too (its decode kernel needs kv_lora_rank + qk_rope_head_dim = 576, like the real model).
"""

from __future__ import annotations

import json
from pathlib import Path

# Kimi-K2.5's language model (moonshotai/Kimi-K2.5 config.json text_config), for shape tests
KIMI_K25_TEXT = {
    "model_type": "deepseek_v3",
    "architectures": ["DeepseekV3ForCausalLM"],
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 1,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "head_dim": 64,
    "vocab_size": 163840,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-5,
    "rope_theta": 50000.0,
    "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                     "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "tie_word_embeddings": False,
}


def tiny_deepseek(out: Path, tokenizer_from: Path, model_type: str = "deepseek_v3", layers: int = 8, seed: int = 0,
                  rope: dict | None = None) -> Path:
    """A random DeepSeek-V3 (or -V2) causal LM with SmolLM2's tokenizer; `model_type="kimi_k2"`
    writes the config the way Kimi-K2 ships it (model_type kimi_k2, class DeepseekV3ForCausalLM)."""
    import torch
    from transformers import AutoTokenizer, DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    out = Path(out)
    if (out / "config.json").exists():
        return out
    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                  first_k_dense_replace=1, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
                  max_position_embeddings=4096, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                  tie_word_embeddings=False)
    scaling = rope or {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 32, "beta_slow": 1,
                       "mscale": 1.0, "mscale_all_dim": 1.0}
    torch.manual_seed(seed)
    if model_type == "deepseek_v2":
        cfg = DeepseekV2Config(**common, q_lora_rank=None, topk_method="greedy", n_group=1, topk_group=1,
                               rope_scaling=scaling, rope_theta=50000.0)
        model = DeepseekV2ForCausalLM(cfg)
    else:
        # topk_method/scoring_func as in DeepSeek-V3's config.json (vLLM reads them; transformers keeps them)
        cfg = DeepseekV3Config(**common, q_lora_rank=32, n_group=2, topk_group=1, rope_scaling=scaling, rope_theta=50000.0,
                               topk_method="noaux_tc", scoring_func="sigmoid")
        model = DeepseekV3ForCausalLM(cfg)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(out)
    if model_type == "kimi_k2":
        c = json.loads((out / "config.json").read_text())
        c["model_type"] = "kimi_k2"
        (out / "config.json").write_text(json.dumps(c, indent=2))
    return out
