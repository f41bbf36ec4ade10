"""Shared bits for benchmarks: machine/version info and result files."""

from __future__ import annotations

import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    from eaglenest.utils import machine_info

    return machine_info()


def write_result(name: str, result: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    result.setdefault("date", datetime.now(timezone.utc).isoformat(timespec="seconds"))
    result.setdefault("command", " ".join([os.path.basename(sys.executable)] + sys.argv))
    result.setdefault("machine", machine())
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return path
