"""Live: vLLM 0.32 serves our exported DFlash draft (`method: "dflash"`) on the CPU.

The draft is over-fitted on purpose, so that acceptance is high and known per block slot: the eight
prompts of learning_helpers with SmolLM2's own greedy answers (conftest `smol_regen`: hf engine,
fp32), captured at DFlash's five layers, and a one-layer DFlash draft (block 8) trained on them
with test_draft_learning's DFlash recipe (learning_helpers.RECIPES).  Served by vLLM and run by our
decoder on the same eight prompts, fp32 (so that the two engines' greedy text does not part at
bf16 near-ties, and the comparison is about wiring, not rounding):
  * the draft learned: its last training accuracy reaches the recipe's floor at every block slot;
  * vLLM's speculative output equals its own non-speculative greedy output (or parts only at a
    near-tie of the baseline's top-2 logprobs), ours equals plain greedy decoding exactly where
    the set-up probe finds verification exact;
  * vLLM, like our decoder, accepts each block slot (given the earlier ones were accepted) within
    learning_helpers.WITHIN plus two standard errors of the training accuracy at that slot: it
    decodes the text the draft was trained on;
  * tau(ours) and tau(vLLM), counted alike (learning_helpers.counted_tau), agree within 5 %.
"""

from __future__ import annotations

import json

import pytest

from learning_helpers import (RECIPES, assert_accepts_as_trained, capture, conditional, counted_tau, eval_args, export, train_acc,
                              train_recipe)
from test_vllm_live_eval import assert_bf16_greedy_agreement
from vllm_helpers import requires_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow, requires_vllm]

BLOCK = 8  # the recipe's block_size


@pytest.fixture(scope="module")
def dflash_draft(smollm2, smol_regen, tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash_live")
    feats = capture(smollm2, smol_regen.data, root / "feats", "dflash")
    run = train_recipe(smollm2, feats, root / "run", "dflash")
    return export(run, root / "draft"), train_acc(run)[1]


def test_vllm_serves_our_dflash_draft_like_our_decoder(smollm2, smol_regen, dflash_draft, tmp_path):
    from eaglenest.evaluate.run import evaluate

    draft, acc = dflash_draft
    bench = smol_regen.bench
    rv = evaluate(eval_args(smollm2, draft, bench, tmp_path / "vllm.json", "vllm", engine_args={"log_dir": str(tmp_path / "logs")}))
    rh = evaluate(eval_args(smollm2, draft, bench, tmp_path / "hf.json", "hf"))
    keys = ("tau", "accept_per_position", "verify_steps", "greedy_matches_baseline")
    print("train acc:", json.dumps(acc))
    print("vllm:", json.dumps({k: rv[k] for k in keys}), "conditional:", json.dumps(conditional(rv["accept_per_position"])))
    print("ours:", json.dumps({k: rh[k] for k in keys}), "conditional:", json.dumps(conditional(rh["accept_per_position"])))
    assert rv["steps"] == rh["steps"] == BLOCK - 1 == len(acc)  # num_speculative_tokens = block_size - 1
    assert min(acc) >= RECIPES["dflash"].floor, acc  # the draft learned its answers (test_draft_learning's bar)
    # served as DFlash (no assert on vLLM's log wording): its drafts are counted and accepted like ours, below
    assert rv["vllm_speculative_config"]["method"] == "dflash" and rv["verify_steps"] > 0
    assert_bf16_greedy_agreement(rv)  # vLLM speculative == vLLM plain, but at near-ties of its top-2
    if rh["verification"]["exact"]:
        assert rh["greedy_matches_baseline"] is True
    assert_accepts_as_trained(rv, acc)
    assert_accepts_as_trained(rh, acc)
    tv, th = counted_tau(rv), counted_tau(rh)
    assert abs(tv - th) <= 0.05 * th, (tv, th)
