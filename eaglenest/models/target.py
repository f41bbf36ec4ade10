"""Loading a target model/tokenizer by path or by a known short name (e.g. `smollm2`)."""

from __future__ import annotations

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
