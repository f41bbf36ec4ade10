"""The portable EAGLE-3 draft checkpoint that both SGLang and vLLM load (engines.md §4).

DRAFT_DIR/config.json + DRAFT_DIR/model.safetensors, keys exactly:
  fc.weight, midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight,
  midlayer.self_attn.{q,k,v,o}_proj.weight, midlayer.mlp.{gate,up,down}_proj.weight,
  norm.weight, lm_head.weight, d2t (int64), t2d (bool)  -- and never embed_tokens.

Aux layer ids: omitted when they are the canonical [2, N//2, N-3] (then both engines pick the
same canonical layers by themselves); otherwise written top-level in capture-before form (vLLM)
and in `eagle_config` in output-of form (SGLang) -- check-draft warns about SGLang's +1 quirk.
The `eaglenest` block carries our own exact config (engines ignore unknown keys).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eaglenest import EaglenestError
from eaglenest.capture.layers import default_layer_ids, to_output_of
from eaglenest.draft.model import DraftConfig, Eagle3Draft
from eaglenest.utils import atomic_write_json, read_json

WEIGHT_DTYPE = torch.bfloat16


def expected_tensors(cfg: DraftConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    H, I, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    w = WEIGHT_DTYPE
    return {
        "fc.weight": ((H, 3 * cfg.target_hidden_size), w),
        "midlayer.input_layernorm.weight": ((H,), w),
        "midlayer.hidden_norm.weight": ((H,), w),
        "midlayer.post_attention_layernorm.weight": ((H,), w),
        "midlayer.self_attn.q_proj.weight": ((q, 2 * H), w),
        "midlayer.self_attn.k_proj.weight": ((kv, 2 * H), w),
        "midlayer.self_attn.v_proj.weight": ((kv, 2 * H), w),
        "midlayer.self_attn.o_proj.weight": ((H, q), w),
        "midlayer.mlp.gate_proj.weight": ((I, H), w),
        "midlayer.mlp.up_proj.weight": ((I, H), w),
        "midlayer.mlp.down_proj.weight": ((H, I), w),
        "norm.weight": ((H,), w),
        "lm_head.weight": ((cfg.draft_vocab_size, H), w),
        "d2t": ((cfg.draft_vocab_size,), torch.int64),
        "t2d": ((cfg.vocab_size,), torch.bool),
    }


def hf_config(cfg: DraftConfig, extra: dict | None = None) -> dict:
    rope = dict(cfg.rope_parameters)
    rope_theta = float(rope.get("rope_theta", 10000.0))
    rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    if rope_scaling.get("rope_type", "default") == "default":
        rope_scaling = None
    c = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "hidden_act": cfg.hidden_act,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "rope_parameters": rope,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "eaglenest": {"draft_config": cfg.to_dict(), "layer_convention": "capture-before", **(extra or {})},
    }
    if list(cfg.aux_layer_ids) != default_layer_ids(cfg.target_num_layers):
        c["eagle_aux_hidden_state_layer_ids"] = list(cfg.aux_layer_ids)  # vLLM: capture-before
        c["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": to_output_of(cfg.aux_layer_ids)}  # SGLang: output-of
    return c


def save_draft(model: Eagle3Draft, out: Path | str, extra: dict | None = None) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    sd = {}
    for k, v in model.exported_state_dict().items():
        v = v.detach().cpu()
        sd[k] = v.to(WEIGHT_DTYPE) if v.is_floating_point() else v
        sd[k] = sd[k].contiguous()
    exp = expected_tensors(model.cfg)
    if set(sd) != set(exp):
        raise EaglenestError(f"internal: export keys differ from the contract: {sorted(set(sd) ^ set(exp))}")
    tmp = out / "model.safetensors.tmp"
    save_file(sd, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / "model.safetensors")
    atomic_write_json(out / "config.json", hf_config(model.cfg, extra))
    return out


def read_draft_config(draft_dir: Path | str) -> tuple[dict, DraftConfig]:
    draft_dir = Path(draft_dir)
    raw = read_json(draft_dir / "config.json", "draft config")
    if "eaglenest" in raw and "draft_config" in raw["eaglenest"]:
        return raw, DraftConfig.from_dict(raw["eaglenest"]["draft_config"])
    # a draft from another trainer: rebuild from the Llama fields
    rope = raw.get("rope_parameters") or {**(raw.get("rope_scaling") or {"rope_type": "default"}), "rope_theta": raw.get("rope_theta", 10000.0)}
    ids = raw.get("eagle_aux_hidden_state_layer_ids")
    n = raw.get("eaglenest", {}).get("target_num_layers") or 0
    cfg = DraftConfig(
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=raw.get("num_key_value_heads", raw["num_attention_heads"]),
        head_dim=raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
        vocab_size=raw["vocab_size"],
        draft_vocab_size=raw.get("draft_vocab_size", raw["vocab_size"]),
        target_hidden_size=raw.get("target_hidden_size", raw["hidden_size"]),
        aux_layer_ids=list(ids) if ids else [],
        target_num_layers=n,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        hidden_act=raw.get("hidden_act", "silu"),
        max_position_embeddings=raw.get("max_position_embeddings", 8192),
        rope_parameters=rope,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=raw.get("eos_token_id"),
    )
    return raw, cfg


def read_draft_tensors(draft_dir: Path | str) -> dict[str, torch.Tensor]:
    path = Path(draft_dir) / "model.safetensors"
    if not path.exists():
        raise EaglenestError(f"{path} not found: not an exported draft")
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def load_draft(
    draft_dir: Path | str,
    embed_weight: torch.Tensor | None = None,
    target_config=None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Eagle3Draft:
    """Load an exported draft; `embed_weight` is the target's input embedding matrix."""
    raw, cfg = read_draft_config(draft_dir)
    if not cfg.aux_layer_ids and target_config is not None:
        cfg.target_num_layers = target_config.num_hidden_layers
        cfg.aux_layer_ids = default_layer_ids(cfg.target_num_layers)
    tensors = read_draft_tensors(draft_dir)
    model = Eagle3Draft(cfg, embed_weight=embed_weight)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    missing = [k for k in missing if not k.startswith(("embed_tokens", "rotary"))]
    if missing or unexpected:
        raise EaglenestError(f"{draft_dir}: draft weights do not match the EAGLE-3 layout (missing {missing}, unexpected {unexpected})")
    return model.to(device=device, dtype=dtype).eval()
