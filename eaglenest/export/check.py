"""`eaglenest check-draft`: validate a draft against its target, judged the way each consumer uses it.

Consumers: `sglang` (0.5.23), `vllm` (0.32) and `hf` (eaglenest's own decoder, `eval --engine hf`).
A draft from another trainer (SpecForge, TorchSpec, speculators) is accepted where the engines
accept it: a missing `target_hidden_size` means the target's width (both engines), a missing
`draft_vocab_size` the full vocabulary (vLLM), an `embed_tokens` in the file is replaced by the
target's in SGLang but used as the draft's own by vLLM when it differs from the target's.  Each
problem is one line naming the field or tensor, prefixed by the consumers it affects; the layers
each engine will capture are computed from the target class's rule (export/layer_ids.py) and
compared with the layers the draft was trained on.

What is judged beyond the shared checks (common to every kind: eaglenest/kinds/common.py) is the
draft kind's (`DraftKind.judge`; EAGLE-3's flags and attentions: kinds/eagle3.py; DFlash:
kinds/dflash.py).
"""

from __future__ import annotations

from pathlib import Path

from eaglenest import EaglenestError
from eaglenest.export.format import DraftDir, read_draft
from eaglenest.kinds.common import CONSUMERS, Report
from eaglenest.kinds.registry import get as get_kind

__all__ = ["CONSUMERS", "Report", "assert_draft_ok", "check_draft", "judge", "judge_draft"]


def judge_draft(draft_dir: "Path | str | DraftDir", model: str | Path | None = None, trained: list[int] | None = None,
                weights: bool = True) -> Report:
    """Everything check-draft knows about a draft, per consumer.  `trained` (capture-before ids)
    overrides the layers read from the config (see export/layer_ids.py `trained_layers`);
    `weights=False` judges config.json alone (what `eval` does before it starts an engine)."""
    d = read_draft(draft_dir)
    return judge(d.raw, d.cfg, d.tensors() if weights else None, model, trained)


def judge(raw: dict, cfg, tensors: dict | None, model=None, trained: list[int] | None = None) -> Report:
    """`judge_draft` on a config and its tensors (None: the config alone); meta tensors (a draft too
    big to write, e.g. the Kimi-K2.5 shape in a test) get the shape and dtype checks only.
    `model`: a target directory, known name or config dict."""
    r = Report()
    get_kind(cfg.kind).judge(r, raw, cfg, tensors, model, trained)
    return r


def check_draft(draft_dir: Path | str, model: str | Path | None = None, engines=CONSUMERS, trained=None,
                weights: bool = True) -> tuple[list[str], list[str]]:
    """(errors for `engines`, warnings).  Problems that only affect other consumers are warnings."""
    r = judge_draft(draft_dir, model, trained, weights)
    others = [c for c in CONSUMERS if c not in engines]
    return r.errors(engines), r.warnings + [f"(not checked for) {e}" for e in r.errors(others) if e not in r.errors(engines)]


def assert_draft_ok(draft_dir, model=None, engines=CONSUMERS, weights: bool = True) -> list[str]:
    errors, warnings = check_draft(draft_dir, model, engines, weights=weights)
    if errors:
        where = draft_dir.path if isinstance(draft_dir, DraftDir) else draft_dir
        raise EaglenestError(f"{where}: {len(errors)} problem(s): " + "; ".join(errors))
    return warnings
