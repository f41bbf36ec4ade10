"""Loading a target model/tokenizer by path or by a known short name (e.g. `smollm2`)."""

from __future__ import annotations

import json
from pathlib import Path

from eaglenest import EaglenestError
from eaglenest.utils import sha256_file, sha256_text


def resolve_model_path(model: str | Path) -> Path:
    """A directory, or a known name such as `smollm2` (fetched into the cache on first use)."""
    from eaglenest.models.fetch import KNOWN, fetch

    if str(model) in KNOWN:
        return fetch(str(model))
    p = Path(model)
    if not p.exists():
        raise EaglenestError(f"target model not found: {model} (a checkpoint directory, or one of: {', '.join(KNOWN)})")
    if not (p / "config.json").exists():
        raise EaglenestError(f"{p} has no config.json: not a transformers checkpoint")
    return p


def load_tokenizer(model: str | Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    path = resolve_model_path(model)
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if not tok.chat_template:
        raise EaglenestError(f"tokenizer at {path} has no chat template")
    return tok


def load_config(model: str | Path, trust_remote_code: bool = False):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(resolve_model_path(model), trust_remote_code=trust_remote_code)


def load_target(model: str | Path, dtype: str = "bf16", device: str = "cpu", trust_remote_code: bool = False):
    import torch
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(model)
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[dtype]
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, trust_remote_code=trust_remote_code)
    m.eval().requires_grad_(False)
    return m.to(device)


def target_fingerprint(model: str | Path) -> str:
    """Identify a target by its config + weights index (cheap: no hashing of weight bytes)."""
    path = resolve_model_path(model)
    parts = [(path / "config.json").read_text()]
    for f in sorted(path.glob("*.safetensors")):
        parts.append(f"{f.name}:{f.stat().st_size}")
    return sha256_text("\n".join(parts))[:16]


def tokenizer_fingerprint(tok) -> str:
    vocab = tok.get_vocab()
    items = sorted(vocab.items(), key=lambda kv: kv[1])
    return sha256_text("\n".join(f"{i}\t{t}" for t, i in items))[:16]


def template_fingerprint(tok) -> str:
    return sha256_text(tok.chat_template or "")[:16]


__all__ = ["resolve_model_path", "load_tokenizer", "load_config", "load_target", "target_fingerprint", "sha256_file"]


def model_config(model_path: str | Path) -> dict:
    """config.json as a dict, without importing transformers (the server engines only need sizes);
    a multimodal config's `text_config` is the language model's."""
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise EaglenestError(f"cannot read {model_path}/config.json: {e}") from None
    return cfg.get("text_config", cfg) if "num_hidden_layers" not in cfg else cfg


def eos_token_ids(model_path: str | Path) -> list[int]:
    """End-of-sequence ids from generation_config.json (else config.json): the stop tokens."""
    for name in ("generation_config.json", "config.json"):
        try:
            v = json.loads((Path(model_path) / name).read_text()).get("eos_token_id")
        except (OSError, json.JSONDecodeError):
            continue
        ids = [x for x in (v if isinstance(v, list) else [v]) if isinstance(x, int)]
        if ids:
            return list(dict.fromkeys(ids))
    return []
