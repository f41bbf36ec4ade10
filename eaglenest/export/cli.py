"""`eaglenest export --run RUN_DIR --out DRAFT_DIR` and `eaglenest check-draft DRAFT_DIR --model TARGET`."""

from __future__ import annotations

import sys


def register(sub) -> None:
    p = sub.add_parser(
        "export",
        help="write the portable EAGLE-3 checkpoint (SGLang + vLLM)",
        description="Write RUN_DIR's latest checkpoint as DRAFT_DIR/config.json + model.safetensors: the EAGLE-3 "
        "layout both SGLang and vLLM load (fc, midlayer.*, norm, lm_head, d2t, t2d; bf16; no embed_tokens). "
        "The result is validated before the command returns.",
    )
    p.add_argument("--run", required=True, help="training run directory")
    p.add_argument("--out", required=True, help="draft directory to write")
    p.add_argument("--model", default=None, help="target to validate against (default: the run's target)")
    p.set_defaults(func=_export)

    c = sub.add_parser(
        "check-draft",
        help="validate a draft checkpoint against its target",
        description="Validate keys, shapes, dtypes, d2t/t2d consistency, vocab sizes, layer ids, rope and "
        "max_position_embeddings of a draft against its target. Exit 1 with the reasons on any problem.",
    )
    c.add_argument("draft", help="draft directory")
    c.add_argument("--model", default=None, help="target checkpoint directory or known name (smollm2)")
    c.set_defaults(func=_check)


def _export(args) -> int:
    from eaglenest.export.check import assert_draft_ok
    from eaglenest.export.run import export_run
    from eaglenest.utils import read_json
    from pathlib import Path

    out = export_run(args.run, args.out)
    model = args.model or read_json(Path(args.run) / "config.json")["target"]
    for w in assert_draft_ok(out, model):
        print(f"warning: {w}", file=sys.stderr)
    print(out)
    return 0


def _check(args) -> int:
    from eaglenest.export.check import check_draft

    errors, warnings = check_draft(args.draft, args.model)
    for w in warnings:
        print(f"warning: {w}")
    for e in errors:
        print(f"error: {e}")
    print(f"{args.draft}: " + ("OK" if not errors else f"{len(errors)} problem(s)"))
    return 1 if errors else 0
