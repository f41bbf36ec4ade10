"""Target models: fetching real checkpoints offline and loading them."""

from eaglenest.models.target import load_target, load_tokenizer, resolve_model_path, target_fingerprint

__all__ = ["load_target", "load_tokenizer", "resolve_model_path", "target_fingerprint"]
