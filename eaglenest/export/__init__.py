"""Export: the portable EAGLE-3 checkpoint (format.py) and its validation (check.py)."""

from eaglenest.export.format import load_draft, read_draft_config, save_draft

__all__ = ["load_draft", "read_draft_config", "save_draft"]
