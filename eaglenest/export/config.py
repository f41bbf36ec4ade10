"""The options of `eaglenest export` and `eaglenest check-draft`, declared once (their CLIs are
generated from these dataclasses by eaglenest/config.py)."""

from __future__ import annotations

from dataclasses import dataclass

from eaglenest.config import option


@dataclass(kw_only=True)
class ExportConfig:
    run: str = option(help="training run directory")
    out: str = option(help="draft directory to write")
    model: str | None = option(None, "target to validate against (default: the run's target)")
    engine: list[str] | None = option(None, "engine(s) the draft must be servable by (repeatable; default: both)",
                                      choices=["sglang", "vllm"])


@dataclass(kw_only=True)
class CheckDraftConfig:
    draft: str = option(help="draft directory", positional=True)
    model: str | None = option(None, "target checkpoint directory or known name (smollm2)")
    engine: list[str] | None = option(None, "consumer(s) to check for (repeatable; default: all three)",
                                      choices=["sglang", "vllm", "hf"])
    trained_layers: str | None = option(None, "the layers the draft was trained on, capture-before (HF hidden_states index), "
                                        "when its config does not say it the way its trainer's convention is read "
                                        "(see docs/sglang.md)", metavar="A,B,C")
