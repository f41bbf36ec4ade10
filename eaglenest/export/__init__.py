"""Export: a training run's latest checkpoint -> the portable draft directory that SGLang, vLLM
and `eaglenest eval` load (format.py: writing, and reading once as a `DraftDir`; the layout is the
draft kind's, eaglenest/kinds/), with aux layer ids each engine reads right (layer_ids.py),
validated per consumer (check.py, also `eaglenest check-draft`).

Public entry: `run.export_run(RUN_DIR, DRAFT_DIR, engines)` (`eaglenest export`; options:
ExportConfig / CheckDraftConfig in config.py), `format.read_draft`, `format.load_draft`.
Nothing is imported here: the kind modules import export/layer_ids.py, which must not pull in
format.py (it asks the kinds' registry).
"""
