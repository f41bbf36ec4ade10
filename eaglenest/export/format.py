"""The portable EAGLE-3 draft checkpoint that both SGLang and vLLM load (engines.md §4), and
reading drafts written by other trainers.

DRAFT_DIR/config.json + DRAFT_DIR/model.safetensors, keys exactly:
  fc.weight, midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight,
  midlayer.self_attn.* (below), midlayer.mlp.{gate,up,down}_proj.weight,
  norm.weight, lm_head.weight, d2t (int64), t2d (bool)  -- and never embed_tokens;
  EAGLE 3.1 `fc_norm`: fc_norm.{0,1,2}.weight.
Per attention kind (DraftConfig.attention; `KINDS`):
  gqa: `LlamaForCausalLMEagle3`, model_type llama, self_attn.{q,k,v,o}_proj;
  mla: `Eagle3DeepseekV2ForCausalLM`, model_type deepseek_v2, DeepSeek's unfused names
       self_attn.{q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm,
       kv_b_proj, o_proj}: vLLM 0.32 (deepseek_eagle3.py hf_to_vllm_mapper) stacks q_a_proj +
       kv_a_proj_with_mqa into fused_qkv_a_proj, SGLang 0.5.23 (kimi_k25_eagle3.py load_weights)
       concatenates them into fused_qkv_a_proj_with_mqa; both load kv_b_proj whole and split it
       after loading (vLLM's MLA layer; SGLang's post_load_weights: w_kc / w_vc).  Not
       deepseek_v3: vLLM's SpeculativeConfig.hf_config_override turns every deepseek_v3 draft
       config into its DeepSeek MTP model.
`fc_norm` and `norm_output` are written top-level, where both engines read them.
d2t/t2d only with a reduced draft vocabulary: vLLM 0.32 has no parameter for a d2t when the draft
vocabulary is the target's (llama_eagle3.py `draft_id_to_target_id = None`) and refuses the file.

Aux layer ids: written so that each engine captures the trained layers, per the target class's
rule (export/layer_ids.py); omitted when the engines' defaults are those layers.  The
`eaglenest` block carries our own exact config (engines ignore unknown keys).

Other trainers' drafts (SpecForge, TorchSpec: `midlayer.*`, maybe the target's `embed_tokens`;
speculators: `layers.0.*` + `transformer_layer_config`) are read into the same DraftConfig;
export/check.py judges how each engine will use them.

DFlash drafts (`DraftConfig.kind == "dflash"`) have their own layout and config: export/dflash.py;
the functions below dispatch on the kind.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eaglenest import EaglenestError
from eaglenest.draft.model import DraftConfig, Eagle3Draft
from eaglenest.export.layer_ids import ENGINES, config_keys, trained_layers
from eaglenest.models.target import MLA_FIELDS, normalized_rope
from eaglenest.utils import atomic_write_json, read_json

WEIGHT_DTYPE = torch.bfloat16


# the engines' class and config type per attention kind (see the module docstring)
KINDS = {
    "gqa": {"architecture": "LlamaForCausalLMEagle3", "model_type": "llama"},
    "mla": {"architecture": "Eagle3DeepseekV2ForCausalLM", "model_type": "deepseek_v2"},
}
MLA_ARCHITECTURES = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM")  # vLLM's registry; SGLang has the V2 name


def expected_tensors(cfg: DraftConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    if cfg.kind == "dflash":
        from eaglenest.export import dflash

        return dflash.expected_tensors(cfg, WEIGHT_DTYPE)
    H, I = cfg.hidden_size, cfg.intermediate_size
    w = WEIGHT_DTYPE
    return {
        "fc.weight": ((H, 3 * cfg.target_hidden_size), w),
        **({f"fc_norm.{i}.weight": ((cfg.target_hidden_size,), w) for i in range(3)} if cfg.fc_norm else {}),
        "midlayer.input_layernorm.weight": ((H,), w),
        "midlayer.hidden_norm.weight": ((H,), w),
        "midlayer.post_attention_layernorm.weight": ((H,), w),
        **{f"midlayer.self_attn.{k}": v for k, v in attention_tensors(cfg).items()},
        "midlayer.mlp.gate_proj.weight": ((I, H), w),
        "midlayer.mlp.up_proj.weight": ((I, H), w),
        "midlayer.mlp.down_proj.weight": ((H, I), w),
        "norm.weight": ((H,), w),
        "lm_head.weight": ((cfg.draft_vocab_size, H), w),
        **(
            {"d2t": ((cfg.draft_vocab_size,), torch.int64), "t2d": ((cfg.vocab_size,), torch.bool)}
            if cfg.draft_vocab_size < cfg.vocab_size
            else {}
        ),
    }


def attention_tensors(cfg: DraftConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The attention's tensors (names under midlayer.self_attn.) for the draft's kind."""
    H, n, w = cfg.hidden_size, cfg.num_attention_heads, WEIGHT_DTYPE
    if cfg.attention == "mla":
        qd, r, rope = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        q = ({"q_a_proj.weight": ((cfg.q_lora_rank, 2 * H), w), "q_a_layernorm.weight": ((cfg.q_lora_rank,), w),
              "q_b_proj.weight": ((n * qd, cfg.q_lora_rank), w)} if cfg.q_lora_rank else {"q_proj.weight": ((n * qd, 2 * H), w)})
        return {**q, "kv_a_proj_with_mqa.weight": ((r + rope, 2 * H), w), "kv_a_layernorm.weight": ((r,), w),
                "kv_b_proj.weight": ((n * (cfg.qk_nope_head_dim + cfg.v_head_dim), r), w),
                "o_proj.weight": ((H, n * cfg.v_head_dim), w)}
    q, kv = n * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return {"q_proj.weight": ((q, 2 * H), w), "k_proj.weight": ((kv, 2 * H), w), "v_proj.weight": ((kv, 2 * H), w),
            "o_proj.weight": ((H, q), w)}


def layer_config(cfg: DraftConfig, extra: dict | None, engines) -> dict:
    """The config.json keys every draft kind writes alike: the layers' shape, the target's rope
    (rope_theta/rope_scaling for older readers, rope_parameters for newer), the vocabularies, and
    our own `eaglenest` block (the exact DraftConfig; engines ignore unknown keys)."""
    rope = dict(cfg.rope_parameters)
    rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    if rope_scaling.get("rope_type", "default") == "default":
        rope_scaling = None
    if cfg.attention == "mla":
        attn = {"num_key_value_heads": cfg.num_attention_heads, "q_lora_rank": cfg.q_lora_rank, "kv_lora_rank": cfg.kv_lora_rank,
                "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim, "v_head_dim": cfg.v_head_dim,
                "rope_interleave": True}  # GPT-J pairs: vLLM always, SGLang unless this is false
    else:
        attn = {"num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim}
    return {
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        **attn,
        "rms_norm_eps": cfg.rms_norm_eps,
        "hidden_act": cfg.hidden_act,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": float(rope.get("rope_theta", 10000.0)),
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
        "eaglenest": {
            "draft_config": cfg.to_dict(),
            "layer_convention": "capture-before",
            "serving_engines": list(engines),
            **(extra or {}),
        },
    }


def hf_config(cfg: DraftConfig, extra: dict | None = None, engines=ENGINES) -> dict:
    if cfg.kind == "dflash":
        from eaglenest.export import dflash

        return dflash.hf_config(cfg, extra, engines)
    kind = KINDS[cfg.attention]
    c = {"architectures": [kind["architecture"]], "model_type": kind["model_type"], "num_hidden_layers": 1,
         **layer_config(cfg, extra, engines),
         "fc_norm": cfg.fc_norm, "norm_output": cfg.norm_output}  # EAGLE 3.1: top-level keys, as both engines read them
    c.update(config_keys(cfg.target_architecture, cfg.target_num_layers, cfg.aux_layer_ids, engines))
    return c


def save_draft(model: Eagle3Draft, out: Path | str, extra: dict | None = None, engines=ENGINES) -> Path:
    """Write the draft; refuses (EaglenestError) a layer set one of `engines` cannot serve."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    sd = {}
    for k, v in model.exported_state_dict().items():
        v = v.detach().cpu()
        sd[k] = v.to(WEIGHT_DTYPE) if v.is_floating_point() else v
        sd[k] = sd[k].contiguous()
    exp = expected_tensors(model.cfg)
    sd = {k: v for k, v in sd.items() if k in exp or k not in ("d2t", "t2d")}  # no mapping for a full vocabulary
    if set(sd) != set(exp):
        raise EaglenestError(f"internal: export keys differ from the contract: {sorted(set(sd) ^ set(exp))}")
    config = hf_config(model.cfg, extra, engines)  # before any file is written: refuses unservable layers
    tmp = out / "model.safetensors.tmp"
    save_file(sd, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / "model.safetensors")
    atomic_write_json(out / "config.json", config)
    return out


def flat_config(raw: dict) -> dict:
    """A draft config.json as one flat Llama-style dict: the speculators format keeps the layer's
    fields in `transformer_layer_config` and the EAGLE-3 ones at the top (vLLM's
    SpeculatorsConfig does the same flattening; its default for norm_before_residual is True)."""
    if raw.get("speculators_model_type") != "eagle3":
        return raw
    flat = dict(raw.get("transformer_layer_config") or {})
    for k in ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids", "norm_before_fc", "fc_norm", "norm_output"):
        if raw.get(k) is not None:
            flat[k] = raw[k]
    flat["norm_before_residual"] = raw.get("norm_before_residual", True)
    return flat


def config_from_hf(f: dict, **kw) -> DraftConfig:
    """A DraftConfig from another trainer's flat config.json, with the engines' defaults for what it
    leaves out; `kw` sets what depends on the draft kind (its layers, ...)."""
    kw = {"num_key_value_heads": f.get("num_key_value_heads") or f["num_attention_heads"],
          "head_dim": f.get("head_dim") or f["hidden_size"] // f["num_attention_heads"], **kw}
    return DraftConfig(
        hidden_size=f["hidden_size"],
        intermediate_size=f["intermediate_size"],
        num_attention_heads=f["num_attention_heads"],
        vocab_size=f["vocab_size"],
        draft_vocab_size=f.get("draft_vocab_size") or f["vocab_size"],
        target_hidden_size=f.get("target_hidden_size") or f["hidden_size"],
        rms_norm_eps=f.get("rms_norm_eps", 1e-6),
        hidden_act=f.get("hidden_act", "silu"),
        max_position_embeddings=f.get("max_position_embeddings", 8192),
        rope_parameters=normalized_rope(f),
        bos_token_id=f.get("bos_token_id"),
        eos_token_id=f.get("eos_token_id"),
        **kw,
    )


def read_draft_config(draft_dir: Path | str) -> tuple[dict, DraftConfig]:
    """(config.json as written, DraftConfig).  A draft from another trainer gets the engines'
    defaults for what it leaves out (target_hidden_size = hidden_size, draft_vocab_size =
    vocab_size, head_dim = hidden / heads); its aux layers stay [] unless given top-level
    (resolve_aux_layers fills them once the target's layer count is known)."""
    draft_dir = Path(draft_dir)
    raw = read_json(draft_dir / "config.json", "draft config")
    if "eaglenest" in raw and "draft_config" in raw["eaglenest"]:
        return raw, DraftConfig.from_dict(raw["eaglenest"]["draft_config"])
    if is_dflash(raw):
        from eaglenest.export import dflash

        return raw, dflash.read_config(raw, draft_dir)
    f = flat_config(raw)
    missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size") if k not in f]
    if missing:
        raise EaglenestError(f"{draft_dir}/config.json: missing {', '.join(missing)}: not an EAGLE-3 draft config")
    ids = f.get("eagle_aux_hidden_state_layer_ids")
    arch = (raw.get("architectures") or [None])[0]
    mla = arch in MLA_ARCHITECTURES or (arch is None and f.get("kv_lora_rank") is not None)
    kw = dict(num_key_value_heads=f["num_attention_heads"], head_dim=f.get("v_head_dim"),
              **{k: f.get(k) for k in MLA_FIELDS}) if mla else {}
    cfg = config_from_hf(f, aux_layer_ids=list(ids) if ids else [], target_num_layers=0,
                         norm_before_residual=bool(f.get("norm_before_residual", False)),
                         # what the engines read: top-level flags (SGLang also takes use_aux_norm for fc_norm)
                         fc_norm=bool(f.get("fc_norm") or f.get("use_aux_norm")), norm_output=bool(f.get("norm_output")),
                         attention="mla" if mla else "gqa", **kw)
    return raw, cfg


def is_dflash(raw: dict) -> bool:
    """A DFlash draft's config.json (ours or another trainer's)."""
    ours = ((raw.get("eaglenest") or {}).get("draft_config") or {}).get("kind")
    return ours == "dflash" or "DFlashDraftModel" in (raw.get("architectures") or []) or "dflash_config" in raw


def resolve_aux_layers(raw: dict, cfg: DraftConfig, num_layers: int) -> DraftConfig:
    """Fill a draft's trained layers and target layer count for an N-layer target (export/layer_ids.py
    `trained_layers`: our record, else the other trainer's convention, else the canonical layers)."""
    if not cfg.aux_layer_ids:
        cfg.aux_layer_ids = trained_layers(raw, num_layers)[0]
    if not cfg.target_num_layers:
        cfg.target_num_layers = num_layers
    return cfg


def read_draft_tensors(draft_dir: Path | str, kind: str = "eagle3") -> dict[str, torch.Tensor]:
    """The draft's tensors under our names (EAGLE-3: speculators' `layers.0.` is our `midlayer.`;
    DFlash keeps `layers.N.`)."""
    path = Path(draft_dir) / "model.safetensors"
    if not path.exists():
        raise EaglenestError(f"{path} not found: not an exported draft")
    rename = kind == "eagle3"
    try:
        with safe_open(str(path), framework="pt") as f:
            return {(k.replace("layers.0.", "midlayer.", 1) if rename and k.startswith("layers.0.") else k): f.get_tensor(k)
                    for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types for a torn or foreign file
        raise EaglenestError(f"{path}: cannot read the weights ({type(e).__name__}: {e})") from None


# config flags of other trainers' layer variants that eaglenest's decoder does not implement
# (both engines do; check-draft judges them per engine)
UNSUPPORTED_FLAGS = ("norm_before_fc",)


def load_draft(
    draft_dir: Path | str,
    embed_weight: torch.Tensor | None = None,
    target_config=None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    lm_head_weight: torch.Tensor | None = None,
) -> Eagle3Draft:
    """Load a draft (ours or another trainer's); `embed_weight` is the target's input embedding
    matrix, which the draft uses like both engines do when sizes match (an `embed_tokens` in the
    file is not used: check-draft says when vLLM would use it instead); `lm_head_weight`, the
    target's output head, serves a DFlash draft that ships none (the engines share the target's)."""
    raw, cfg = read_draft_config(draft_dir)
    flags = [k for k in UNSUPPORTED_FLAGS if flat_config(raw).get(k)]
    if flags:
        raise EaglenestError(
            f"{draft_dir}: {', '.join(flags)} set: eaglenest's decoder does not implement that layer variant "
            "(SGLang/vLLM do): evaluate it with --engine vllm or --engine sglang"
        )
    if target_config is not None:
        resolve_aux_layers(raw, cfg, target_config.num_hidden_layers)
    tensors = read_draft_tensors(draft_dir, cfg.kind)
    tensors.pop("embed_tokens.weight", None)
    if cfg.kind == "dflash" and "lm_head.weight" not in tensors and lm_head_weight is not None and cfg.draft_vocab_size == cfg.vocab_size:
        tensors["lm_head.weight"] = lm_head_weight.detach()
    from eaglenest.draft import draft_model

    model = draft_model(cfg, embed_weight=embed_weight)
    if "d2t" not in tensors and cfg.draft_vocab_size == cfg.vocab_size:  # full vocabulary: identity mapping
        model.set_vocab(torch.zeros(cfg.vocab_size, dtype=torch.int64), torch.ones(cfg.vocab_size, dtype=torch.bool))
        tensors.update(d2t=model.d2t, t2d=model.t2d)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    missing = [k for k in missing if not k.startswith(("embed_tokens", "rotary"))]
    if missing or unexpected:
        layout = "DFlash" if cfg.kind == "dflash" else f"EAGLE-3 ({cfg.attention} attention, fc_norm {cfg.fc_norm})"
        raise EaglenestError(f"{draft_dir}: draft weights do not match the {layout} layout "
                             f"(missing {missing}, unexpected {unexpected})")
    return model.to(device=device, dtype=dtype).eval()
