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


def target_head(model: str | Path) -> dict[str, torch.Tensor]:
    """{'embed': [V, H], 'lm_head': [V, H], 'norm': [H]} of a Llama-family target (tied heads handled)."""
    names = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]
    t = read_tensors(model, names)
    if "model.embed_tokens.weight" not in t or "model.norm.weight" not in t:
        raise EaglenestError(f"{model}: expected Llama-style tensors model.embed_tokens.weight and model.norm.weight")
    return {
        "embed": t["model.embed_tokens.weight"],
        "lm_head": t.get("lm_head.weight", t["model.embed_tokens.weight"]),  # tied embeddings
        "norm": t["model.norm.weight"],
    }
