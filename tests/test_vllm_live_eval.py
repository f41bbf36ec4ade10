"""Live: vLLM serves our exported draft (`method: eagle3`) and `eaglenest eval --engine vllm`
reports tau from /metrics with the in-process evaluator's report keys.

A random-init draft exported with `save_draft` is served on SmolLM2: it must load (sharing the
target's embeddings), report what the in-process evaluator reports, and its greedy outputs must
agree with the non-speculative server's as far as bf16 allows: vLLM verifies 4 tokens in one batched
forward, which on some CPUs (an AMD EPYC without AMX) is not bit-identical to decoding them one by
one, so a generation may part from the baseline -- but only at a token where the baseline's top-2
logprobs nearly tie.  Its tau (~1 on both sides) says nothing about serving; a draft that is always
right does: on a target that repeats its last prompt token, vLLM must accept every draft token, as
our decoder does.
The demo's trained draft (the session's `demo --quick` run, or EAGLENEST_VLLM_AGREEMENT_DRAFT=DIR)
must be accepted by vLLM exactly as by our decoder in fp32 (prompt by prompt) and within 5 % in
bf16 (3 steps, greedy, the same MT-bench prompts).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from helpers_eval import eval_args
from vllm_helpers import make_echo_target, make_oracle_draft, make_random_draft, requires_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow, requires_vllm]

# Largest baseline logprob margin, at a divergence, that bf16 rounding explains: SmolLM2's logits are
# ~8-32, where one bf16 step is 0.06-0.125, so a few steps of batch-dependent rounding fit in it; a
# wiring bug parts at a clear winner (margins of whole nats).  Measured on an AMD EPYC without AMX:
# one divergence in 4 generations, at an exact tie (margin 0.0).
NEAR_TIE = 0.5

PROMPTS = [
    {"question_id": "q1", "turns": ["What is the capital of France?", "And of Italy?"]},
    {"question_id": "q2", "prompt": "Write a haiku about the sea."},
    {"question_id": "q3", "prompt": "Give me three tips for writing clean Python code."},
]


def _args(smollm2, draft, bench, out, engine, **kw):
    return eval_args(smollm2, draft, bench, out, engine, **{"steps": 3, "max_new_tokens": 32, "device": "cpu", "dtype": "bf16", **kw})


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    p = tmp_path_factory.mktemp("bench") / "bench.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    return p


def test_serve_random_draft(smollm2, bench, tmp_path):
    from eaglenest.evaluate.run import evaluate

    draft = make_random_draft(tmp_path / "draft", smollm2)
    rv = evaluate(_args(smollm2, draft, bench, tmp_path / "vllm.json", "vllm", turns=2,
                        engine_args={"log_dir": str(tmp_path / "logs")}))
    print("vllm report:", json.dumps({k: v for k, v in rv.items() if k not in ("per_prompt", "machine")}))
    assert rv["engine"] == "vllm" and rv["n_generations"] == 4 and rv["verify_steps"] > 0
    assert rv["tau"] is not None and 1.0 <= rv["tau"] < 1.1, "a random draft is (almost) never accepted"
    assert_bf16_greedy_agreement(rv)
    assert rv["vllm_draft_shares_target_embeddings"] is True
    assert rv["vllm_unaccounted_tokens"] == 0
    assert (tmp_path / "logs" / "spec" / "server.log").exists()  # kept where log_dir says (its wording is vLLM's)

    # the in-process evaluator on the same draft: the same report keys (one short generation: the
    # in-process decoder is slow on a busy 2-core machine; tau is compared on a draft with acceptance below)
    rh = evaluate(_args(smollm2, draft, bench, tmp_path / "hf.json", "hf", no_baseline=True, limit=1, max_new_tokens=16))
    missing = set(rh) - set(rv) - {"device", "verification"}  # verification: the in-process decoder's probe
    assert not missing, f"vLLM report lacks keys of the HF report: {sorted(missing)}"
    assert set(rh["per_prompt"][0]) <= set(rv["per_prompt"][0])


def test_serve_a_draft_that_is_always_right(smollm2, bench, tmp_path):
    """A tiny target that repeats its last prompt token and a draft built to propose exactly that
    (tests/vllm_helpers.py: make_echo_target, make_oracle_draft; its token sits at draft index 1, so
    the served d2t offsets matter).  Every draft token is right, so vLLM must accept all 3 in every
    round, prompt by prompt as our decoder does: a draft misloaded (lm_head, d2t, fc) or acceptance
    miscounted shows as tau near 1.  33 new tokens: the first from the prefill, then 8 full rounds."""
    from eaglenest.evaluate.run import evaluate

    target = make_echo_target(tmp_path / "echo", smollm2)
    draft = make_oracle_draft(tmp_path / "draft", target)
    kw = dict(no_baseline=True, max_new_tokens=33)
    rv = evaluate(_args(target, draft, bench, tmp_path / "vllm.json", "vllm", **kw))
    rh = evaluate(_args(target, draft, bench, tmp_path / "hf.json", "hf", **kw))
    for r in (rv, rh):
        print(f"{r['engine']}: tau {r['tau']} per position {r['accept_per_position']}")
        assert r["accept_per_position"] == [1.0, 1.0, 1.0] and r["tau"] == 4.0
        assert [p["verify_steps"] for p in r["per_prompt"]] == [8] * len(PROMPTS)
    assert [p["output_ids"] for p in rv["per_prompt"]] == [p["output_ids"] for p in rh["per_prompt"]]


def test_tau_agreement_at_temperature_1(smollm2, quick_demo, tmp_path):
    """Temperature 1, the draft's tokens sampled from its distribution q and verified with
    min(1, p/q) on both sides (vLLM `draft_sample_method: probabilistic`, ours `--draft-sampling
    sample`): the same draft and MT-bench prompts, bf16, tau within 5 %.  The two engines draw
    different random streams, so the texts differ and tau agrees in expectation: 20 prompts x 96
    tokens (~1,500 verification steps each) keep the sampling noise of the difference near 1.5 %.
    On a CPU vLLM needs our plugin for this (engines/vllm_fixes.py: its CPU fallback expands the
    temperature of speculative positions into uninitialized memory); the report says what the
    plugin did in the server.  Measured with the demo recipe's draft: bench/results/vllm_agreement_t1_demo.json."""
    from eaglenest.evaluate.run import evaluate

    draft = Path(os.environ.get("EAGLENEST_VLLM_AGREEMENT_DRAFT") or quick_demo / "draft")
    kw = dict(limit=20, max_new_tokens=96, no_baseline=True, temperature=1.0, dtype="bf16", draft_sampling="sample")
    # vLLM decodes the 20 prompts as one batch (engine arg concurrency: tau from the run's counters), which
    # its CPU server finishes sooner than one at a time
    rv = evaluate(_args(smollm2, draft, "mtbench", tmp_path / "vllm.json", "vllm", engine_args={"concurrency": 20}, **kw))
    rh = evaluate(_args(smollm2, draft, "mtbench", tmp_path / "hf.json", "hf", **kw))
    print(f"T=1: tau vllm {rv['tau']:.3f} ({rv['verify_steps']} steps) hf {rh['tau']:.3f} ({rh['verify_steps']} steps); "
          f"per position vllm {rv['accept_per_position']} hf {rh['accept_per_position']}")
    assert rv["vllm_speculative_config"]["draft_sample_method"] == "probabilistic"
    assert rv["vllm_fixes"], "our vLLM plugin did not run in the server (engines/vllm_fixes.py)"
    assert rv["draft_sampling"] == rh["draft_sampling"] == "sample" and rv["batch_size"] == 20
    assert rv["n_generations"] == 20 and all("tau" not in x for x in rv["per_prompt"])  # counted together
    assert rh["accept_per_position"][0] > 0, "the trained draft should be accepted sometimes"
    assert abs(rv["tau"] - rh["tau"]) <= 0.05 * rh["tau"], (rv["tau"], rh["tau"])


def test_temperature_1_is_refused_when_the_server_did_not_load_our_plugin(smollm2, quick_demo, tmp_path, monkeypatch):
    """VLLM_PLUGINS naming other plugins keeps ours out of the server: eval reads that from the
    server's log and refuses to report temperature > 0 numbers (corrupt on a CPU vLLM 0.32)."""
    from eaglenest import EaglenestError
    from eaglenest.evaluate.run import evaluate

    monkeypatch.setenv("VLLM_PLUGINS", "some_other_plugin")
    with pytest.raises(EaglenestError, match="did not load eaglenest's plugin"):
        evaluate(_args(smollm2, quick_demo / "draft", "mtbench", tmp_path / "v.json", "vllm", limit=1, max_new_tokens=8,
                       no_baseline=True, temperature=1.0, draft_sampling="sample"))


def assert_bf16_greedy_agreement(r: dict) -> None:
    """Every greedy generation equals the baseline's, or parts from it at a near-tie of the
    baseline's own top-2 (a later turn may then differ from its prompt on)."""
    mm = r.get("greedy_mismatches") or []
    parted = set()
    for m in mm:
        print(f"greedy divergence: prompt {m['id']} turn {m['turn']} at {m['where']}: "
              f"logprob gap {m.get('logprob_gap')} top-2 {m.get('baseline_top_logprobs')}")
        if m["where"].startswith("prompt"):
            assert (m["id"], m["turn"] - 1) in parted, m  # only after an earlier turn parted
        else:
            assert m["logprob_gap"] is not None and 0 <= m["logprob_gap"] <= NEAR_TIE, m
        parted.add((m["id"], m["turn"]))
    assert r["greedy_matches_baseline"] is (not mm)


def _same_text(rv: dict, rh: dict) -> list[tuple[dict, dict]]:
    pairs = list(zip(rv["per_prompt"], rh["per_prompt"]))
    assert [v["id"] for v, _ in pairs] == [h["id"] for _, h in pairs]
    return [(v, h) for v, h in pairs if v["output_ids"] == h["output_ids"]]


def test_tau_agreement_with_the_demo_draft(smollm2, quick_demo, tmp_path):
    """The demo's trained draft (`demo --quick`'s, or EAGLENEST_VLLM_AGREEMENT_DRAFT=DIR) served by
    vLLM and run by our decoder on the same MT-bench prompts, 3 steps, greedy.

    fp32 separates wiring from numerics: both engines then write the same text, so a draft that
    vLLM runs exactly as we do is accepted at the same positions, prompt by prompt (measured: all
    prompts identical, per-position counts equal).  bf16 is what users run: the tau values must
    agree within 5 %.  Measured here with the quick draft, 10 prompts x 64 tokens: fp32 vLLM 1.113,
    ours 1.113, 10/10 texts identical; bf16 vLLM 1.101, ours 1.137 (3.2 %), 2/10 texts identical
    (two bf16 implementations of the target greedy-decode different text).  On an AMD EPYC without
    AMX, with our verification made exact by the probe (evaluate/verification.py; all Linears row-wise in
    fp32 there): fp32 1.103 both, 10/10 identical; bf16 vLLM 1.103, ours 1.114 (1.0 %), 1/10."""
    from eaglenest.evaluate.run import evaluate

    draft = Path(os.environ.get("EAGLENEST_VLLM_AGREEMENT_DRAFT") or quick_demo / "draft")
    kw = dict(limit=10, max_new_tokens=64, no_baseline=True)
    r = {}
    for dtype in ("fp32", "bf16"):
        for eng in ("vllm", "hf"):
            r[dtype, eng] = evaluate(_args(smollm2, draft, "mtbench", tmp_path / f"{eng}-{dtype}.json", eng, dtype=dtype, **kw))
        rv, rh = r[dtype, "vllm"], r[dtype, "hf"]
        same = _same_text(rv, rh)
        print(f"{dtype}: tau vllm {rv['tau']:.3f} hf {rh['tau']:.3f}; per position vllm {rv['accept_per_position']} "
              f"hf {rh['accept_per_position']}; identical outputs {len(same)}/{len(rv['per_prompt'])}")
    rv, rh = r["fp32", "vllm"], r["fp32", "hf"]
    same = _same_text(rv, rh)
    assert len(same) >= len(rv["per_prompt"]) - 1, "fp32 greedy text should not depend on the engine"
    acc_v = [sum(v["accepted_per_position"][i] for v, _ in same) for i in range(3)]
    acc_h = [sum(h["accepted_per_position"][i] for _, h in same) for i in range(3)]
    steps_v, steps_h = sum(v["verify_steps"] for v, _ in same), sum(h["verify_steps"] for _, h in same)
    assert acc_v[0] > 0, "the trained draft should be accepted sometimes"
    assert abs(steps_v - steps_h) <= 0.02 * steps_h and all(abs(x - y) <= max(1, 0.03 * y) for x, y in zip(acc_v, acc_h)), (acc_v, acc_h)
    assert abs(rv["tau"] - rh["tau"]) <= 0.02 * rh["tau"], (rv["tau"], rh["tau"])
    rv, rh = r["bf16", "vllm"], r["bf16", "hf"]
    assert abs(rv["tau"] - rh["tau"]) <= 0.05 * rh["tau"], (rv["tau"], rh["tau"])
