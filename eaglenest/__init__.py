"""eaglenest: train EAGLE-3 draft models for speculative decoding.

Pipeline (one package per stage): data (prepare) -> capture (engines) -> features (store)
-> train (draft) -> export -> evaluate.  This top-level module stays import-light on purpose:
vLLM worker processes import `eaglenest.engines.vllm_connector` and must not pay for torch
or transformers twice.
"""

import os

__version__ = "0.1.0"

# oneDNN keeps a JIT kernel per matmul shape (up to 1024 by default, read when its first kernel is
# built); training's variable-length batches fill it with GBs of host RAM (bench/results/
# git show 0c8d13e:bench/results/train_cpu_memory.json).  64 costs no speed here.  A value the user set wins.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")


class EaglenestError(Exception):
    """A user-facing error: the CLI prints its message on one line, with no traceback."""
