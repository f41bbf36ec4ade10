"""bench/draft_kinds.py's report: arms an earlier run measured on another machine are kept as that run
wrote them, with where they came from; arms trained here are paired with the EAGLE-3 recipe re-run
here (bench/losses.py's `ce` arm) only when that run's training command is EAGLE-3's own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def bench(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLENEST_BENCH_WORK", str(tmp_path))
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import arms
    import draft_kinds

    monkeypatch.setattr(arms, "model_path", lambda: "/models/smollm2")  # no model is read
    return draft_kinds, arms


def _trained(arms, name: str, extra: list[str]) -> None:
    d = arms.arm_dir(name)
    (d / "run").mkdir(parents=True)
    (d / "run" / "final.json").write_text("{}")
    for t in (0.0, 1.0):
        arms.eval_report(name, t).write_text("{}")
    argv = ["train", "--model", "/models/smollm2", "--features", str(arms.work_root() / "features"), "--out", str(d / "run"),
            *arms.train_flags(), *extra]
    (d / "timing.json").write_text(json.dumps({"argv": argv}))


def test_the_reference_is_eagle3_trained_here_or_the_same_training_under_another_name(bench):
    dk, arms = bench
    assert dk.reference_arm() is None  # nothing here to pair with
    _trained(arms, "l-ce", ["--lr", "0.002", "--loss", "ce"])  # another recipe is not EAGLE-3's
    assert dk.reference_arm() is None
    bench_dir = arms.arm_dir("l-ce")
    for p in sorted(bench_dir.rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    _trained(arms, "l-ce", ["--loss", "ce"])  # the default loss, spelled out: the same training
    assert dk.reference_arm() == "l-ce"
    _trained(arms, "k-eagle3", [])
    assert dk.reference_arm() == "k-eagle3"


def test_an_arm_measured_elsewhere_is_carried_with_its_provenance(bench):
    dk, _ = bench
    prev = {"date": "2026-12-01T00:00:00+00:00", "git_commit": "abc", "machine": {"cpu_model": "X"},
            "smollm2": {"arms": {"k-eagle31": {"flags": ["--fc-norm", "--norm-output"], "eval": {"t0": {"tau": 1.45}}}}}}
    a = dk._carried(prev, "k-eagle31")
    assert a["eval"]["t0"]["tau"] == 1.45
    assert a["carried_from"] == {"date": prev["date"], "git_commit": "abc", "machine": {"cpu_model": "X"}}
    assert dk._carried(prev, "k-fcnorm") is None and dk._carried(None, "k-eagle31") is None  # never made up
