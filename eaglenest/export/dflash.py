"""The DFlash draft checkpoint in the format vLLM 0.32 loads (`method: "dflash"`), read back by
eaglenest's own decoder; format.py dispatches here on the draft's kind.

DRAFT_DIR/config.json (read by vLLM's qwen3_dflash.py / v1/spec_decode/dflash.py, SGLang's
dflash_utils.parse_dflash_draft_config):
  architectures ["DFlashDraftModel"], model_type "qwen3" (a Qwen3Config: q/k norms, no bias),
  num_hidden_layers = the draft's layers, the layer shape, the target's rope, vocab_size,
  draft_vocab_size, target_hidden_size, block_size (vLLM serves num_speculative_tokens =
  block_size - 1), dflash_config {mask_token_id, target_layer_ids (output-of: both engines capture
  before id + 1; export/layer_ids.py), causal: false, use_swa: false}, num_target_layers, and our
  own `eaglenest` block (engines ignore unknown keys).
DRAFT_DIR/model.safetensors, keys exactly:
  fc.weight [H, n*H_t], hidden_norm.weight, norm.weight,
  layers.N.{input_layernorm, post_attention_layernorm}.weight,
  layers.N.self_attn.{q,k,v,o}_proj.weight, layers.N.self_attn.{q,k}_norm.weight [head_dim],
  layers.N.mlp.{gate,up,down}_proj.weight, lm_head.weight [draft_vocab, H],
  d2t (int64) + t2d (bool) only with a reduced vocabulary (vLLM maps d2t to draft_id_to_target_id
  and skips t2d; with the full vocabulary it has no parameter for d2t) -- never embed_tokens (both
  engines then use the target's; the MASK slot is the target's embedding of mask_token_id).
"""

from __future__ import annotations

import torch

from eaglenest import EaglenestError
from eaglenest.draft.model import DraftConfig
from eaglenest.export.layer_ids import dflash_target_layer_ids, dflash_trained_layers

ARCHITECTURE = "DFlashDraftModel"


def expected_tensors(cfg: DraftConfig, weight_dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    H, I, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    w = weight_dtype
    out = {
        "fc.weight": ((H, len(cfg.aux_layer_ids) * cfg.target_hidden_size), w),
        "hidden_norm.weight": ((H,), w),
        "norm.weight": ((H,), w),
        "lm_head.weight": ((cfg.draft_vocab_size, H), w),
    }
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        out.update({
            p + "input_layernorm.weight": ((H,), w),
            p + "post_attention_layernorm.weight": ((H,), w),
            p + "self_attn.q_proj.weight": ((q, H), w),
            p + "self_attn.k_proj.weight": ((kv, H), w),
            p + "self_attn.v_proj.weight": ((kv, H), w),
            p + "self_attn.o_proj.weight": ((H, q), w),
            p + "self_attn.q_norm.weight": ((hd,), w),
            p + "self_attn.k_norm.weight": ((hd,), w),
            p + "mlp.gate_proj.weight": ((I, H), w),
            p + "mlp.up_proj.weight": ((I, H), w),
            p + "mlp.down_proj.weight": ((H, I), w),
        })
    if cfg.draft_vocab_size < cfg.vocab_size:
        out.update({"d2t": ((cfg.draft_vocab_size,), torch.int64), "t2d": ((cfg.vocab_size,), torch.bool)})
    return out


def hf_config(cfg: DraftConfig, extra: dict | None = None, engines=("vllm",)) -> dict:
    """config.json; refuses (EaglenestError) target layers the engines cannot capture."""
    from eaglenest.export.format import layer_config

    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "num_hidden_layers": cfg.num_hidden_layers,
        "layer_types": ["full_attention"] * cfg.num_hidden_layers,
        **layer_config(cfg, extra, engines),
        "num_target_layers": cfg.target_num_layers,
        "block_size": cfg.block_size,
        "dflash_config": {
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": dflash_target_layer_ids(cfg.aux_layer_ids, cfg.target_num_layers),
            "causal": False,  # non-causal inside the block, as trained
            "use_swa": False,
        },
        "attention_dropout": 0.0,
        "use_sliding_window": False,
    }


def read_config(raw: dict, draft_dir) -> DraftConfig:
    """A DFlash config.json written by another trainer (SpecForge, z-lab) as a DraftConfig: target
    layers from dflash_config.target_layer_ids (output-of -> capture-before), block_size and
    mask_token_id top-level or in dflash_config."""
    dc = raw.get("dflash_config") or {}
    missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size") if k not in raw]
    if missing:
        raise EaglenestError(f"{draft_dir}/config.json: missing {', '.join(missing)}: not a DFlash draft config")
    block = raw.get("block_size", dc.get("block_size"))
    mask = dc.get("mask_token_id", raw.get("mask_token_id"))
    if block is None or mask is None:
        raise EaglenestError(f"{draft_dir}/config.json: a DFlash draft needs block_size and dflash_config.mask_token_id "
                             f"(got {block!r}, {mask!r})")
    from eaglenest.export.format import config_from_hf

    return config_from_hf(raw, aux_layer_ids=dflash_trained_layers(raw), target_num_layers=int(raw.get("num_target_layers") or 0),
                          kind="dflash", num_hidden_layers=int(raw.get("num_hidden_layers", 1)), block_size=int(block),
                          mask_token_id=int(mask))


def judge(r, raw: dict, cfg: DraftConfig, tensors: dict | None, model=None, trained: list[int] | None = None) -> None:
    """check-draft for a DFlash draft (export/check.py's Report `r`, per consumer): what vLLM 0.32
    (qwen3_dflash.py) and SGLang 0.5.23 (srt/models/dflash.py, GPU-only here) do with it, and whether
    eaglenest's own decoder (evaluate/dflash.py) runs it."""
    from eaglenest.export.check import _judge_tensors

    r.notes.append("DFlash draft (block drafter): served by vLLM 0.32 with method \"dflash\", num_speculative_tokens = "
                   f"block_size - 1 = {cfg.block_size - 1}; SGLang 0.5.23 serves DFLASH on a GPU only (Triton kernels), "
                   "not run here")
    archs = raw.get("architectures") or []
    if ARCHITECTURE not in archs:
        r.error(f"config.json: architectures {archs!r}: the engines resolve DFlash drafts as {ARCHITECTURE}", ["vllm", "sglang"])
    if not raw.get("model_type"):
        r.error("config.json: no model_type: vLLM builds the draft's config with transformers' AutoConfig (ours: qwen3)", ["vllm"])
    dc = raw.get("dflash_config") or {}
    if "block_size" not in raw and "block_size" not in dc:
        r.error("config.json: no block_size (SGLang defaults to 16; the draft was trained on one block size)", ["sglang", "hf"])
    if dc.get("mask_token_id") is None:
        r.error("config.json: no dflash_config.mask_token_id: vLLM feeds masked slots token 0")
    elif not 0 <= int(dc["mask_token_id"]) < cfg.vocab_size:
        r.error(f"dflash_config.mask_token_id {dc['mask_token_id']} is outside the vocabulary (0..{cfg.vocab_size - 1})")
    if dc.get("causal") or raw.get("is_causal") or dc.get("use_swa") or "sliding_attention" in (raw.get("layer_types") or []):
        r.error("causal or sliding-window draft attention: eaglenest's decoder drafts non-causal full-attention blocks", ["hf"])
    if raw.get("eagle_aux_hidden_state_layer_ids"):
        r.notes.append("a top-level eagle_aux_hidden_state_layer_ids: vLLM captures those instead of dflash_config.target_layer_ids")
    if tensors is not None:
        shared_head = cfg.draft_vocab_size == cfg.vocab_size and "lm_head.weight" not in tensors
        if shared_head:  # SpecForge's / z-lab's drafts: no head of their own
            r.notes.append("no lm_head.weight: vLLM, SGLang and eaglenest's decoder use the target's lm_head")
        _judge_tensors(r, cfg, tensors, optional=("lm_head.weight",) if shared_head else ())
        if cfg.draft_vocab_size < cfg.vocab_size:
            r.error("a reduced draft vocabulary (lm_head + d2t): SGLang 0.5.23's DFLASH has no draft head, it proposes with the "
                    "target's lm_head, not the trained one", ["sglang"])
    if model is None:
        return
    from eaglenest.export.check import _judge_shape_fit
    from eaglenest.export.layer_ids import SGLANG_DFLASH_CLASSES, VLLM_EAGLE3_CLASSES
    from eaglenest.models.target import target_facts

    t = target_facts(model)
    n = t.num_layers
    _judge_shape_fit(r, raw, cfg, t, "eaglenest" in raw)
    if tensors is not None and cfg.draft_vocab_size == cfg.vocab_size and "lm_head.weight" in tensors and t.vocab_size == cfg.vocab_size:
        from eaglenest.models.weights import target_head

        if not torch.equal(tensors["lm_head.weight"].float(), target_head(model)["lm_head"].float()):
            r.error("lm_head.weight differs from the target's: SGLang 0.5.23's DFLASH proposes with the target's lm_head", ["sglang"])
    ids = list(trained) if trained else list(cfg.aux_layer_ids)
    r.notes.append(f"trained on target layers {ids} (capture-before)")
    if not ids or any(not 1 <= k <= n - 1 for k in ids) or sorted(set(ids)) != ids:
        r.error(f"target layers {ids} are not increasing capture-before ids in 1..{n - 1} for a {n}-layer target "
                "(eaglenest captures at a decoder layer's input)", ["hf"])
    if not ids or any(not 1 <= k <= n for k in ids) or sorted(set(ids)) != ids:
        r.error(f"target layers {ids} are not increasing capture-before ids in 1..{n} for a {n}-layer target", ["vllm", "sglang"])
        return
    got = dflash_trained_layers(raw)
    vllm_got = list(raw.get("eagle_aux_hidden_state_layer_ids") or got)
    if vllm_got != ids:
        r.error(f"would capture before layers {vllm_got}, the draft was trained on {ids}", ["vllm"])
    if got != ids:
        r.error(f"would capture before layers {got} (dflash_config.target_layer_ids + 1), the draft was trained on {ids}", ["sglang"])
    if t.architecture not in VLLM_EAGLE3_CLASSES:
        r.error(f"vLLM 0.32: target class {t.architecture} does not provide aux hidden states (SupportsEagle3): no DFlash draft on it",
                ["vllm"])
    if t.architecture not in SGLANG_DFLASH_CLASSES:
        r.error(f"SGLang 0.5.23: target class {t.architecture} has no set_dflash_layers_to_capture: no DFlash draft on it", ["sglang"])
