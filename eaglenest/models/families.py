"""What differs between target families, as data: adding a family is one entry in FAMILIES.

A family is keyed by the `model_type` of the language model: config.json's own, or its
`text_config`'s for a multimodal checkpoint (Kimi-K2.5 = `kimi_k25` wrapping a `deepseek_v3`).  Everything else eaglenest needs to know about a target
(the facts derived from its config, tokenizer and weights) is computed in `models/target.py`
from these entries; the serving engines' per-class layer-id rules live in `export/layer_ids.py`
(keyed by the target's architecture class, which is what SGLang and vLLM dispatch on).
"""

from __future__ import annotations

from dataclasses import dataclass

# Kimi-K2.5's EAGLE-3 draft (TorchSpec, see shared/docs/engines.md §4): hidden 7168 -> intermediate 12288
KIMI_DRAFT_INTERMEDIATE_RATIO = 12288 / 7168


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    architecture: str  # the causal-LM class a config without `architectures` is served as
    attention: str = "gqa"  # "gqa" (heads x head_dim, KV heads) or "mla" (DeepSeek's latent attention)
    moe: bool = False
    # the final norm before lm_head: "rms" = w * x / rms(x) (Llama); "rms_1p" = (1 + w) * x / rms(x) (Gemma)
    final_norm: str = "rms"
    # config key holding tanh soft-capping of the final logits (Gemma 2), None when the family has none
    logit_softcap_key: str | None = None
    # transformers model_type to load the checkpoint with when its own model_type is not registered
    # there (Kimi-K2 ships `kimi_k2` + remote code; the architecture is DeepseekV3ForCausalLM)
    load_as: str | None = None
    # the draft's MLP width, as a multiple of the hidden size; None = the target's intermediate_size
    draft_intermediate_ratio: float | None = None


FAMILIES: tuple[Family, ...] = (
    Family("llama", ("llama", "mistral"), "LlamaForCausalLM"),
    Family("qwen2", ("qwen2",), "Qwen2ForCausalLM"),
    Family("qwen3", ("qwen3",), "Qwen3ForCausalLM"),
    Family("qwen2_moe", ("qwen2_moe",), "Qwen2MoeForCausalLM", moe=True),
    Family("qwen3_moe", ("qwen3_moe",), "Qwen3MoeForCausalLM", moe=True),
    Family("deepseek_v2", ("deepseek_v2",), "DeepseekV2ForCausalLM", attention="mla", moe=True, draft_intermediate_ratio=KIMI_DRAFT_INTERMEDIATE_RATIO),
    Family("deepseek_v3", ("deepseek_v3",), "DeepseekV3ForCausalLM", attention="mla", moe=True, draft_intermediate_ratio=KIMI_DRAFT_INTERMEDIATE_RATIO),
    Family("kimi_k2", ("kimi_k2",), "DeepseekV3ForCausalLM", attention="mla", moe=True, load_as="deepseek_v3",
           draft_intermediate_ratio=KIMI_DRAFT_INTERMEDIATE_RATIO),
    Family("glm4_moe_lite", ("glm4_moe_lite",), "Glm4MoeLiteForCausalLM", attention="mla", moe=True, draft_intermediate_ratio=KIMI_DRAFT_INTERMEDIATE_RATIO),
    Family("glm4_moe", ("glm4_moe",), "Glm4MoeForCausalLM", moe=True),
    Family("gpt_oss", ("gpt_oss",), "GptOssForCausalLM", moe=True),
    Family("minimax_m2", ("minimax_m2",), "MiniMaxM2ForCausalLM", moe=True),
    Family("gemma3", ("gemma3_text",), "Gemma3ForCausalLM", final_norm="rms_1p", logit_softcap_key="final_logit_softcapping"),
    Family("gemma2", ("gemma2",), "Gemma2ForCausalLM", final_norm="rms_1p", logit_softcap_key="final_logit_softcapping"),
)

BY_MODEL_TYPE = {mt: f for f in FAMILIES for mt in f.model_types}
