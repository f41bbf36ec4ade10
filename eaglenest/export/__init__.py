"""Export: a training run's latest checkpoint -> the portable EAGLE-3 draft directory that SGLang,
vLLM and `eaglenest eval` load (format.py), with aux layer ids each engine reads right
(layer_ids.py), validated per consumer (check.py, also `eaglenest check-draft`).

Public entry: `run.export_run(RUN_DIR, DRAFT_DIR, engines)` (`eaglenest export`; options:
ExportConfig / CheckDraftConfig in config.py).
"""

from eaglenest.export.format import load_draft, read_draft_config, save_draft

__all__ = ["load_draft", "read_draft_config", "save_draft"]
