"""Export a training run's latest checkpoint as the portable draft directory."""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file

from eaglenest import EaglenestError
from eaglenest.draft import draft_model
from eaglenest.draft.config import DraftConfig
from eaglenest.export.format import save_draft
from eaglenest.export.layer_ids import ENGINES
from eaglenest.kinds.registry import get as get_kind
from eaglenest.utils import read_json


def latest_checkpoint(run: Path) -> Path:
    latest = run / "checkpoints" / "latest.json"
    if not latest.exists():
        raise EaglenestError(f"{run} has no checkpoint (checkpoints/latest.json missing): train first")
    return run / "checkpoints" / read_json(latest)["dir"]


def export_run(run: Path | str, out: Path | str, engines=ENGINES) -> Path:
    run = Path(run)
    rc = read_json(run / "config.json", "run config")
    cfg = DraftConfig.from_dict(rc["draft"])
    if cfg.target_architecture is None:  # a run from before the architecture was recorded
        from eaglenest.models.target import target_facts

        cfg.target_architecture = target_facts(rc["target"]).architecture
    ck = latest_checkpoint(run)
    model = draft_model(cfg)
    missing, unexpected = model.load_state_dict(load_file(str(ck / "model.safetensors")), strict=False)
    missing = [k for k in missing if not k.startswith(("embed_tokens", "rotary"))]
    if missing or unexpected:
        raise EaglenestError(f"{ck}: checkpoint does not match the draft (missing {missing}, unexpected {unexpected})")
    final = read_json(run / "final.json") if (run / "final.json").exists() else {}
    extra = {
        "target": rc.get("target"),
        "target_fingerprint": rc.get("store", {}).get("target_fingerprint"),
        "trained_steps": read_json(ck / "trainer_state.json")["step"],
        **get_kind(cfg.kind).export_extra(rc["train"]),
        "held_out": final.get("eval"),
    }
    return save_draft(model, out, extra, engines)
