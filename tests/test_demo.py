"""End to end on the real SmolLM2 target and real data: `eaglenest demo --quick` (the CI run of the
whole pipeline: fetch, prepare ShareGPT, capture, train, export, check-draft, eval on MT-bench)."""

import json

import pytest

from eaglenest.cli import main

pytestmark = pytest.mark.slow


def test_demo_quick_end_to_end(quick_demo):
    out = quick_demo
    r = json.loads((out / "report.json").read_text())
    for f in ("report.md", "loss.png", "acc.png", "draft/config.json", "draft/model.safetensors"):
        assert (out / f).exists(), f
    assert r["steps"] == 3 and r["topk"] == 1 and r["temperature"] == 0 and r["dataset"] == "mtbench"
    assert r["n_prompts"] == 6 and r["verify_steps"] > 0
    # tau counts the bonus token, so an always-wrong draft scores exactly 1.0 (tests/test_eval_*);
    # a random-init draft measured 1.00 on this benchmark and the quick draft ~1.14 (6 prompts,
    # 48 tokens; deterministic on CPU).  1.05 separates "learned something" from chance.
    assert r["tau"] > 1.05, r["tau"]
    # the eval probed this machine's kernels (evaluate/verification.py) and made verification exact: the
    # demo's claim "greedy output == plain greedy" must hold on every CPU, AMX or not
    v = r["verification"]
    assert v["attention"] == "rowwise" and v["dtype"] == "bfloat16" and v["exact"] is True, v
    assert v["probe_result"]["rows_probed"] == [4] and v["probe_result"]["end_to_end"][-1]["exact"] is True
    flagged = {tuple(x["shape"]) for x in v["rowwise"]["linears"]}
    assert flagged == {tuple(x["shape"]) for x in v["probe_result"]["linears"] if any(x["differing"].values())} or v["rowwise"]["all_linears"]
    assert r["greedy_matches_baseline"] is True, r.get("greedy_mismatches")
    # the verdict covers the prompts decoded both ways (the preset's baseline_limit), and says so
    assert r["baseline_prompts"] == r["texts_compared"] == r["demo"]["recipe"]["baseline_limit"] == 6
    assert "6 of 6 generations compared" in (out / "report.md").read_text()
    assert "verification" in (out / "report.md").read_text() and "exact (probed)" in (out / "report.md").read_text()
    assert len(r["accept_per_position"]) == 3 and r["accept_per_position"][0] > 0
    # the draft is what both engines load
    assert main(["check-draft", str(out / "draft"), "--model", "smollm2"]) == 0
