"""Draft kinds: each kind is one module that registers a `DraftKind` (registry.py) holding its
config, model, training objective, checkpoint writer/reader, per-engine judge and decoder hook;
EAGLE-3 (eagle3.py, with its 3.1 norms and MLA attention as options) and DFlash (dflash.py).
What the kinds share in the checkpoint and in check-draft is common.py.

Public entry: `registry.get(name)` / `registry.detect(config_json)`; a new kind calls
`registry.register(...)`.  Only the registry is imported here (draft/ imports it; the kind modules
import draft/, so importing them here would be a circle).
"""

from eaglenest.kinds.registry import DraftKind, detect, get, names, register

__all__ = ["DraftKind", "detect", "get", "names", "register"]
