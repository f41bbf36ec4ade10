"""Read single tensors from a target checkpoint without loading the whole model."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from eaglenest import EaglenestError
from eaglenest.models.target import resolve_model_path


def _index(path: Path) -> dict[str, str]:
    idx = path / "model.safetensors.index.json"
    if idx.exists():
        return json.loads(idx.read_text())["weight_map"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise EaglenestError(f"{path}: no safetensors weights found")
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            out.update({k: f.name for k in h.keys()})
    return out


def read_tensors(model: str | Path, names: list[str]) -> dict[str, torch.Tensor]:
    path = resolve_model_path(model)
    index = _index(path)
    out = {}
    for n in names:
        if n not in index:
            continue
        with safe_open(str(path / index[n]), framework="pt") as h:
            out[n] = h.get_tensor(n)
    return out


# where a checkpoint keeps its language model: plain causal LMs, then multimodal wrappers
# (transformers 5 `model.language_model.*`; Kimi-K2.5 / older VLMs `language_model.model.*`)
_LM_PREFIXES = ("model.", "model.language_model.", "language_model.model.")
_HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight", "model.lm_head.weight")


def target_head(model: str | Path) -> dict:
    """The teacher's pieces of a target, per its family (models/families.py):
    {'embed': [V, H], 'lm_head': [V, H] (tied embeddings handled), 'norm': [H] as the multiplier
    of x / rms(x) (Gemma's (1 + w) already added), 'norm_eps', 'logit_softcap' (None or the tanh cap)}."""
    from eaglenest.models.target import target_facts

    facts = target_facts(model)
    index = _index(resolve_model_path(model))
    prefix = next((p for p in _LM_PREFIXES if f"{p}embed_tokens.weight" in index and f"{p}norm.weight" in index), None)
    if prefix is None:
        raise EaglenestError(f"{model}: no embed_tokens.weight + norm.weight under any of {', '.join(_LM_PREFIXES)}")
    head_name = next((n for n in _HEAD_NAMES if n in index), None)
    names = [f"{prefix}embed_tokens.weight", f"{prefix}norm.weight"] + ([head_name] if head_name else [])
    t = read_tensors(model, names)
    embed, norm = t[names[0]], t[names[1]]
    if facts.family.final_norm == "rms_1p":
        norm = 1.0 + norm.float()
    return {
        "embed": embed,
        "lm_head": t[head_name] if head_name else embed,  # tied embeddings
        "norm": norm,
        "norm_eps": facts.rms_norm_eps,
        "logit_softcap": facts.logit_softcap,
    }
