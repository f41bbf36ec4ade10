"""eaglenest: train EAGLE-3 draft models for speculative decoding.

Pipeline (one package per stage): data (prepare) -> capture (engines) -> features (store)
-> train (draft) -> export -> evaluate.  This top-level module stays import-light on purpose:
vLLM worker processes import `eaglenest.engines.vllm_connector` and must not pay for torch
or transformers twice.
"""

__version__ = "0.1.0"


class EaglenestError(Exception):
    """A user-facing error: the CLI prints its message on one line, with no traceback."""
