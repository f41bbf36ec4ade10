"""`eaglenest export --run RUN_DIR --out DRAFT_DIR` and `eaglenest check-draft DRAFT_DIR --model TARGET`: options
are ExportConfig's and CheckDraftConfig's fields (eaglenest/export/config.py)."""

from __future__ import annotations

import sys

from eaglenest.config import add_command


def register(sub) -> None:
    from eaglenest.export.config import CheckDraftConfig, ExportConfig

    add_command(
        sub, ExportConfig, _export,
        "export",
        help="write the portable draft checkpoint (EAGLE-3: SGLang + vLLM; DFlash: vLLM)",
        description="Write RUN_DIR's latest checkpoint as DRAFT_DIR/config.json + model.safetensors: the EAGLE-3 "
        "layout both SGLang and vLLM load (fc, midlayer.*, norm, lm_head, d2t, t2d; bf16; no embed_tokens), or a DFlash "
        "draft in the layout vLLM 0.32 loads with method \"dflash\" (DFlashDraftModel: fc, hidden_norm, layers.N.*, norm, "
        "lm_head, d2t; kinds/dflash.py; checked for vLLM by default: SGLang serves DFlash on GPUs only, with the "
        "target's lm_head). "
        "Aux layer ids are written so that each engine captures the trained layers on this target's class "
        "(docs/sglang.md); a layer set an engine cannot express is refused with the reason. "
        "The result is validated before the command returns. Options can come from a YAML file (--config; flags win).",
    )

    add_command(
        sub, CheckDraftConfig, _check,
        "check-draft",
        help="validate a draft checkpoint against its target, per engine",
        description="Validate keys, shapes, dtypes, d2t/t2d consistency, vocab sizes, rope, max_position_embeddings "
        "and aux layer ids of a draft (eaglenest's, SpecForge's, TorchSpec's or the speculators format) against its "
        "target, judged the way each consumer uses it: sglang (0.5.23), vllm (0.32), hf (eaglenest eval). "
        "Exit 1 with the reasons on any problem for the checked consumers. Options can come from a YAML file "
        "(--config; flags win).",
    )


def _export(cfg, args) -> int:
    from pathlib import Path

    from eaglenest.export.check import assert_draft_ok
    from eaglenest.export.layer_ids import ENGINES
    from eaglenest.export.run import export_run
    from eaglenest.kinds.registry import get as get_kind
    from eaglenest.utils import read_json

    rc = read_json(Path(cfg.run) / "config.json", "run config")
    kind = get_kind((rc.get("draft") or {}).get("kind"))
    engines = tuple(cfg.engine or kind.default_engines or ENGINES)  # DFlash: vLLM (SGLang serves it on GPUs only)
    out = export_run(cfg.run, cfg.out, engines)
    model = cfg.model or rc["target"]
    for w in assert_draft_ok(out, model, engines=(*engines, "hf")):
        print(f"warning: {w}", file=sys.stderr)
    print(out)
    return 0


def _check(cfg, args) -> int:
    from eaglenest import EaglenestError
    from eaglenest.export.check import CONSUMERS, judge_draft

    trained = None
    if cfg.trained_layers:
        try:
            trained = [int(x) for x in cfg.trained_layers.split(",")]
        except ValueError:
            raise EaglenestError(f"--trained-layers must be integers like 2,15,27 (got {cfg.trained_layers!r})") from None
    r = judge_draft(cfg.draft, cfg.model, trained)
    consumers = tuple(cfg.engine or CONSUMERS)
    for n in r.notes:
        print(f"note: {n}")
    for w in r.warnings:
        print(f"warning: {w}")
    errors = r.errors(consumers)
    for e in errors:
        print(f"error: {e}")
    verdicts = ", ".join(f"{c} {'OK' if r.ok_for(c) else 'NO'}" for c in consumers)
    print(f"{cfg.draft}: {verdicts}" + ("" if not errors else f" ({len(errors)} problem(s))"))
    return 1 if errors else 0
