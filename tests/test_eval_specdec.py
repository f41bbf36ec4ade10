"""Speculative decoding over the tiny random Llama: greedy equivalence, tau accounting, KV-cache
cropping/gathering, the tree proposal and the draft cache against slow recomputations.

Greedy equivalence relies on verification.prepare's probe finding verification bit-identical to plain
decoding on this machine: the exact_tiny / tiny_bf16_exact fixtures run their tests wherever it does,
on any CPU, and skip with the probe's reason where it does not (tests/cpu_kind.py); that the probe's
remedy restores exactness is asserted everywhere (test_verification.py).  Tests that compare with a
tolerance use the model either way."""

from __future__ import annotations

import pytest
import torch
from cpu_kind import amx_cpu, bf16_matrix_cpu, gemv_cpu, require_exact
from helpers_eval import (KINDS, chunk_and_one_by_one, load_tiny, oracle_chain, oracle_tree, plain_greedy, random_draft,
                          spec_equals_plain)

from eaglenest.draft.model import cache_length
from eaglenest.evaluate.specdec import PlainDecoder, SpecDecoder, resolve_num_draft_tokens
from eaglenest.evaluate.verification import prepare

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[1, 500, 600, 700, 800], [1, 9690, 198, 2683, 359, 253], [1, 42], list(range(1, 40, 3))]
N_NEW = 24
ROWS = [4, 7, 12]  # the verification sizes whose exactness the tests below rely on


def test_not_exact_skips_with_the_probes_reason_on_any_cpu():
    not_exact = {"exact": False, "probe_result": {"end_to_end": [{"first_difference": "row 3 logits differ"}]}}
    with pytest.raises(pytest.skip.Exception, match="not bit-identical .*: row 3 logits differ"):
        require_exact(not_exact)
    require_exact({"exact": True})


def test_cpu_flags_are_read_from_cpuinfo():
    intel = "vendor_id\t: GenuineIntel\nflags\t\t: fpu avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"
    amd = "vendor_id\t: AuthenticAMD\nflags\t\t: fpu avx512f avx512_bf16\n"
    avx2 = "vendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2 fma\n"
    assert [bf16_matrix_cpu(c) for c in (intel, amd, avx2)] == [True, True, False]
    assert [amx_cpu(c) for c in (intel, amd, avx2)] == [True, False, False]
    assert [gemv_cpu(c) for c in (intel, amd, avx2, "flags\t: fpu avx2\n", "")] == [True, True, True, False, False]


@pytest.fixture(scope="module")
def tiny_verified(tiny_llama_dir):
    m = load_tiny(tiny_llama_dir)  # fp32, re-drawn with a larger std: varied greedy outputs
    return m, prepare(m, rows=ROWS, topk=4)


@pytest.fixture(scope="module")
def tiny(tiny_verified):
    return tiny_verified[0]


@pytest.fixture
def exact_tiny(tiny_verified):
    require_exact(tiny_verified[1])
    return tiny_verified[0]


@pytest.fixture(scope="module")
def draft(tiny):
    return random_draft(tiny, draft_vocab=4096)


@pytest.fixture(scope="module", params=list(KINDS))
def any_draft(request, tiny):
    """Each draft kind: its own cache (K/V or MLA's latent) and feedback (h or norm(h)) in the decoder."""
    return random_draft(tiny, draft_vocab=4096, **KINDS[request.param])


@pytest.fixture(scope="module")
def references(tiny):
    return [plain_greedy(tiny, p, N_NEW) for p in PROMPTS]


def test_reference_is_not_degenerate(references):
    # a target that repeats one token would hide cache bugs
    assert all(len(set(r)) > N_NEW // 2 for r in references)


@pytest.mark.parametrize("topk,ndt", [(1, None), (3, 7), (4, 12)])
def test_greedy_equals_plain_with_random_draft(exact_tiny, tiny, any_draft, references, topk, ndt):
    with SpecDecoder(tiny, any_draft, set(), steps=3, topk=topk, num_draft_tokens=ndt) as sd:
        for p, ref in zip(PROMPTS, references):
            r = sd.generate(p, N_NEW)
            assert r.output_ids == ref
            assert r.verify_steps >= 1 and r.tau >= 1.0


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_rigged_draft_accepts_many_and_stays_exact(exact_tiny, tiny, draft, references, kind):
    steps = 3
    with SpecDecoder(tiny, draft, set(), steps=steps, topk=1 if kind == "chain" else 2, num_draft_tokens=None if kind == "chain" else 7) as sd:
        for p, ref in zip(PROMPTS, references):
            make = oracle_chain if kind == "chain" else oracle_tree
            sd.propose = make(p + ref, len(p), steps).__get__(sd)
            r = sd.generate(p, N_NEW)
            assert r.output_ids == ref  # multi-token acceptance + cache crop/gather keep it exact
            # every round accepts all S drafts and adds the bonus, except where N_NEW truncates
            full = (N_NEW - 1) // (steps + 1)
            assert r.verify_steps == full + (1 if (N_NEW - 1) % (steps + 1) else 0)
            assert r.tau > 1.0
            assert r.accepted_per_position[0] == r.verify_steps


def test_tau_accounting_exact(exact_tiny, tiny, draft, references):
    steps = 3
    p, ref = PROMPTS[0], references[0]
    n = 1 + 5 * (steps + 1)  # prefill token + 5 full rounds: no truncation at the end
    with SpecDecoder(tiny, draft, set(), steps=steps) as sd:
        sd.propose = oracle_chain(p + ref, len(p), steps).__get__(sd)
        perfect = sd.generate(p, n)
        assert perfect.output_ids == ref[:n]
        assert perfect.tau == steps + 1 and perfect.verify_steps == 5
        assert perfect.accepted_per_position == [5, 5, 5]
        sd.propose = oracle_chain(p + ref, len(p), steps, wrong=True).__get__(sd)
        wrong = sd.generate(p, N_NEW)
        assert wrong.output_ids == ref
        assert wrong.tau == 1.0 and wrong.verify_steps == N_NEW - 1
        assert wrong.accepted_per_position == [0, 0, 0]


def test_stops_at_eos(exact_tiny, tiny, draft, references):
    p, ref = PROMPTS[0], references[0]
    eos = ref[5]  # pretend the 6th greedy token ends the answer
    with SpecDecoder(tiny, draft, {eos}, steps=3) as sd:
        sd.propose = oracle_chain(p + ref, len(p), 3).__get__(sd)
        r = sd.generate(p, N_NEW)
    cut = ref.index(eos) + 1
    assert r.output_ids == ref[:cut] and r.finish_reason == "stop"
    assert PlainDecoder(tiny, {eos}).generate(p, N_NEW).output_ids == ref[:cut]


def test_draft_cache_matches_full_recompute(tiny, any_draft):
    """Step-0 entry t = (token x_{t+1}, f_t, position t), built incrementally from prefill and
    verification forwards, equals one causal draft pass over the whole committed sequence (the
    MLA draft's cache is its latent: one [r + rope] vector per position, not per-head K/V)."""
    draft = any_draft
    p = PROMPTS[3]
    with SpecDecoder(tiny, draft, set(), steps=3, topk=2, num_draft_tokens=6) as sd:
        sd.generate(p, N_NEW)
        st = sd.last_round
        n = cache_length(st.draft_cache)
        toks = st.tokens
        from eaglenest.evaluate.specdec import _new_cache

        with torch.inference_mode():
            _, aux = sd._target_forward(toks[:n], _new_cache(tiny))
            ids = torch.tensor([toks[1 : n + 1]])
            causal = torch.ones(n, n, dtype=torch.bool).tril()[None]
            _, want = draft.step(ids, draft.fuse(aux[None]), torch.arange(n)[None], mask=causal)
    assert n > len(p)
    if draft.cfg.attention == "mla":
        c = draft.cfg
        assert len(st.draft_cache) == 1 and st.draft_cache[0].shape == (1, 1, n, c.kv_lora_rank + c.qk_rope_head_dim)
    for got, ref in zip(st.draft_cache, want, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_tree_proposal_scores_match_chain_recompute(tiny, any_draft):
    """Every tree node's cumulative draft log-prob equals feeding its path one token at a time
    (checks the tree attention mask, positions and hidden hand-over: the fed-back state is
    feedback(h) = h, or norm(h) for a norm_output draft, as written out here)."""
    draft = any_draft
    p = PROMPTS[0]
    K, S = 3, 3
    with SpecDecoder(tiny, draft, set(), steps=S, topk=K, num_draft_tokens=1 + K + (S - 1) * K * K) as sd:
        sd.generate(p, 2)  # leaves last_round after the prefill extend + one round
        st = sd.last_round
        with torch.inference_mode():
            prop = sd._propose_tree(st)
            t2d_index = {int(t): i for i, t in enumerate(sd.draft_to_target.tolist())}
            base = cache_length(st.draft_cache) - 1
            for i in range(len(prop.tokens)):
                path = [i]
                while prop.parents[path[-1]] >= 0:
                    path.append(prop.parents[path[-1]])
                path.reverse()
                h, cache, score = st.h_last, st.draft_cache, 0.0
                for j, node in enumerate(path):
                    lp = torch.log_softmax(draft.logits(h[0, -1]).float(), -1)
                    score += float(lp[t2d_index[prop.tokens[node]]])
                    if j < len(path) - 1:
                        ids = torch.tensor([[prop.tokens[node]]])
                        fed = draft.norm(h) if draft.cfg.norm_output else h
                        h, new = draft.step(ids, fed, torch.tensor([[base + j + 1]]), past_kv=cache)
                        cache = tuple(torch.cat([a, b], 2) for a, b in zip(cache, new))
                assert abs(score - prop.scores[i]) < 1e-3, (i, score, prop.scores[i])
    assert len(prop.tokens) == K + (S - 1) * K * K
    # parents come first and depths are consistent
    for i, par in enumerate(prop.parents):
        assert par < i and (par < 0 or prop.depths[par] == prop.depths[i] - 1)


def test_sampled_generation_runs(tiny, draft):
    for topk, ndt in [(1, None), (3, 8)]:
        with SpecDecoder(tiny, draft, set(), steps=3, topk=topk, num_draft_tokens=ndt, temperature=0.8, seed=1) as sd:
            r = sd.generate(PROMPTS[0], 16)
        assert len(r.output_ids) == 16 and r.verify_steps >= 1
        assert all(0 <= t < tiny.config.vocab_size for t in r.output_ids)
    b = PlainDecoder(tiny, set(), temperature=0.8, seed=1).generate(PROMPTS[0], 16)
    assert len(b.output_ids) == 16


def test_num_draft_tokens_rules():
    from eaglenest import EaglenestError

    assert resolve_num_draft_tokens(3, 1, None) == 4
    assert resolve_num_draft_tokens(3, 4, None) == 13
    assert resolve_num_draft_tokens(2, 4, 21) == 21
    with pytest.raises(EaglenestError, match="steps\\+1"):
        resolve_num_draft_tokens(3, 1, 6)
    with pytest.raises(EaglenestError, match="2..21"):
        resolve_num_draft_tokens(2, 4, 22)


@pytest.fixture(scope="module", params=["auto", "torch"])
def tiny_bf16_verified(tiny_llama_dir, request):
    """Both ways of computing the linears: the gemv kernel where it runs (auto), and torch's F.linear."""
    m = load_tiny(tiny_llama_dir, dtype=torch.bfloat16)
    return m, prepare(m, rows=[4, 7], topk=2, linears=request.param)


@pytest.fixture
def tiny_bf16_exact(tiny_bf16_verified):
    m, v = tiny_bf16_verified
    assert v["rowwise"]["attention"] and v["dtype"] == "bfloat16"
    require_exact(v)
    return m


def test_rowwise_verification_makes_chunks_bit_identical(tiny_bf16_exact):
    """Feeding 4 tokens at once gives the same logits bits as feeding them one by one."""
    one, chunk = chunk_and_one_by_one(tiny_bf16_exact, PROMPTS[3], [700, 800, 900, 1000])
    assert torch.equal(one, chunk)


def test_bf16_spec_equals_plain_exactly(tiny_bf16_exact):
    spec_equals_plain(tiny_bf16_exact, PROMPTS, N_NEW)

