"""`eaglenest check-draft`: validate a draft checkpoint against its target, loudly.

Each problem is one line naming the tensor or field; warnings are things that load but may
serve badly (e.g. non-canonical layer ids, which SGLang versions interpret differently).
"""

from __future__ import annotations

from pathlib import Path

import torch

from eaglenest import EaglenestError
from eaglenest.capture.layers import default_layer_ids
from eaglenest.draft.vocab import check_vocab
from eaglenest.export.format import expected_tensors, read_draft_config, read_draft_tensors


def _rope_of(cfg) -> dict:
    rope = getattr(cfg, "rope_parameters", None)
    if not rope:
        rope = dict(getattr(cfg, "rope_scaling", None) or {"rope_type": "default"})
        rope["rope_theta"] = getattr(cfg, "rope_theta", 10000.0)
    rope = dict(rope)
    rope.setdefault("rope_type", rope.pop("type", "default"))
    return rope


def check_draft(draft_dir: Path | str, model: str | Path | None = None) -> tuple[list[str], list[str]]:
    """Returns (errors, warnings). With `model`, also checks the fit to that target."""
    draft_dir = Path(draft_dir)
    errors: list[str] = []
    warnings: list[str] = []
    raw, cfg = read_draft_config(draft_dir)
    for key, want in (("architectures", ["LlamaForCausalLMEagle3"]), ("model_type", "llama"), ("num_hidden_layers", 1), ("tie_word_embeddings", False)):
        if raw.get(key) != want:
            errors.append(f"config.json: {key} is {raw.get(key)!r}, expected {want!r}")
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size", "draft_vocab_size", "target_hidden_size", "max_position_embeddings"):
        if key not in raw:
            errors.append(f"config.json: missing {key}")
    tensors = read_draft_tensors(draft_dir)
    exp = expected_tensors(cfg)
    for k in sorted(set(tensors) - set(exp)):
        errors.append(f"model.safetensors: unexpected tensor {k}" + (" (engines would use it instead of the target's embeddings)" if "embed" in k else ""))
    for k, (shape, dtype) in exp.items():
        if k not in tensors:
            errors.append(f"model.safetensors: missing {k}" + (" (served without it, acceptance collapses to 1.0)" if k == "lm_head.weight" else ""))
            continue
        t = tensors[k]
        if tuple(t.shape) != shape:
            errors.append(f"model.safetensors: {k} has shape {tuple(t.shape)}, expected {shape}")
        if t.dtype != dtype and not (t.is_floating_point() and dtype.is_floating_point):
            errors.append(f"model.safetensors: {k} has dtype {t.dtype}, expected {dtype}")
        elif t.is_floating_point() and not torch.isfinite(t.float()).all():
            errors.append(f"model.safetensors: {k} contains NaN/Inf")
    if "d2t" in tensors and "t2d" in tensors:
        why = check_vocab(tensors["d2t"], tensors["t2d"])
        if why:
            errors.append(f"vocabulary mapping: {why}")

    if model is not None:
        from eaglenest.models.target import load_config

        t = load_config(model)
        n = t.num_hidden_layers
        if cfg.target_hidden_size != t.hidden_size:
            errors.append(f"target_hidden_size {cfg.target_hidden_size} != target hidden_size {t.hidden_size}: this draft is for another target")
        if cfg.hidden_size != t.hidden_size:
            errors.append(f"hidden_size {cfg.hidden_size} != target hidden_size {t.hidden_size} (engines share the target's embeddings)")
        if cfg.vocab_size != t.vocab_size:
            errors.append(f"vocab_size {cfg.vocab_size} != target vocab_size {t.vocab_size}: this draft is for another tokenizer")
        if cfg.draft_vocab_size > t.vocab_size:
            errors.append(f"draft_vocab_size {cfg.draft_vocab_size} exceeds the target vocabulary {t.vocab_size}")
        if cfg.max_position_embeddings < t.max_position_embeddings:
            errors.append(
                f"max_position_embeddings {cfg.max_position_embeddings} < target's {t.max_position_embeddings} (engines clamp the draft's RoPE)"
            )
        want_rope, got_rope = _rope_of(t), dict(cfg.rope_parameters)
        if {k: v for k, v in want_rope.items()} != {k: v for k, v in got_rope.items()}:
            errors.append(f"rope parameters {got_rope} differ from the target's {want_rope}")
        ids = raw.get("eagle_aux_hidden_state_layer_ids")
        ours = raw.get("eaglenest", {}).get("draft_config", {}).get("aux_layer_ids")
        if ours and ids is None and list(ours) != default_layer_ids(n):
            errors.append(f"trained on layers {ours} but config.json names none (engines would use {default_layer_ids(n)})")
        if ids is not None:
            if any(not 1 <= k <= n - 1 for k in ids):
                errors.append(f"eagle_aux_hidden_state_layer_ids {ids} out of range for a {n}-layer target")
            if list(ids) != default_layer_ids(n):
                warnings.append(
                    f"non-canonical aux layers {ids} (capture-before): vLLM reads them as written; SGLang reads "
                    "eagle_config's output-of ids and some versions add +1 only when the first id is 1: check your SGLang version"
                )
        if ours and raw.get("eaglenest", {}).get("draft_config", {}).get("target_num_layers") not in (None, n):
            errors.append(f"trained for a {raw['eaglenest']['draft_config']['target_num_layers']}-layer target, this one has {n}")
    return errors, warnings


def assert_draft_ok(draft_dir, model=None) -> list[str]:
    errors, warnings = check_draft(draft_dir, model)
    if errors:
        raise EaglenestError(f"{draft_dir}: {len(errors)} problem(s): " + "; ".join(errors))
    return warnings
