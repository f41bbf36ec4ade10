"""Speculative sampling at temperature 1 leaves the target's distribution unchanged: our decoder
(evaluate/specdec.py, the whole of it: prefill, draft cache, chain proposal with a reduced draft
vocabulary, verification, acceptance, correction and bonus tokens, the next round) against the
exact distribution of plain sampling, by a chi-square test over many draws.

Set-up: a tiny random Llama target (vocabulary 12, so the exact joint distribution of the first
three generated tokens is 12^3 teacher-forced probabilities) and a random EAGLE-3 draft over 8 of
the 12 tokens (it cannot propose the other 4: the residual must supply them), 2 draft steps, so
the 2nd and 3rd generated tokens come from accepted drafts, corrections, and the second round.

Test: Pearson's chi-square of the observed (1st, 2nd) and (2nd, 3rd) token pairs against the
exact joint distributions (cells with fewer than 5 expected draws pooled), each at significance
0.001 (family-wise <= 0.002 per decoder).  Draw count: N = 2000 generations per decoder.  Its
power is computed, not assumed: against two plausible bugs -- rejecting without the residual
(the replacement drawn from p instead of norm(max(0, p - q))), and accepting against the target
renormalized over the draft vocabulary -- the exact distribution each would produce is computed
from the draft's own q, and 2000 simulated experiments of N draws say how often the test rejects
it: 1.000 for the first (TV 0.22 from the target's (1st, 2nd) distribution; asserted >= 0.99),
0.95 for the second, subtler one (TV 0.08; asserted >= 0.9; 3000 draws would give 0.998).  And
the first bug, patched into the decoder, is caught by the same test.
"""

from __future__ import annotations

import pytest
import torch

from eaglenest.draft.model import Eagle3Config, Eagle3Draft
from eaglenest.draft.vocab import build_vocab
from eaglenest.evaluate import specdec
from eaglenest.evaluate.specdec import PlainDecoder, SpecDecoder

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

V, VD, STEPS = 12, 8, 2
PROMPT = [1, 5, 3]
N = 2000  # generations per decoder
SIGNIFICANCE = 0.001  # per table
MIN_POWER = {"no residual": 0.99, "p renormalized over the draft vocabulary": 0.9}  # computed here: 1.000 and 0.95


@pytest.fixture(scope="module")
def models():
    return build_models()


@pytest.fixture(scope="module")
def exact(models):
    return exact_joint(models[0])


def build_models():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=16, vocab_size=V, max_position_embeddings=64, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    target = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # weights re-drawn so that the distributions are neither flat nor peaked
        for p in target.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        draft = Eagle3Draft(Eagle3Config.from_target(cfg, VD, [0, 1, 2]), embed_weight=target.get_input_embeddings().weight)
        for n, p in draft.named_parameters():
            if p.dim() == 2 and "embed" not in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        usage = torch.softmax(target(torch.randint(0, V, (64, 8), generator=g)).logits, -1).mean((0, 1))
    draft.set_vocab(*build_vocab((usage * 1e6).long(), VD))  # the 8 tokens the target uses most
    return target, draft.eval().requires_grad_(False)


def exact_joint(target):
    """J[a, b, c] = P(first three generated tokens = a, b, c) under plain sampling at temperature 1."""
    with torch.no_grad():
        def nxt(prefixes):
            return torch.softmax(target(torch.tensor([PROMPT + x for x in prefixes])).logits[:, -1].double(), -1)

        p0 = nxt([[]])[0]
        p1 = nxt([[a] for a in range(V)])  # [V, V]
        p2 = nxt([[a, b] for a in range(V) for b in range(V)]).view(V, V, V)
    return p0[:, None, None] * p1[:, :, None] * p2


def draws(decoder, n: int) -> tuple[torch.Tensor, list[int], int]:
    out, accepted, rounds = [], [0] * STEPS, 0
    for _ in range(n):
        r = decoder.generate(PROMPT, 3)
        out.append(r.output_ids[:3])
        accepted = [a + b for a, b in zip(accepted, r.accepted_per_position or [0] * STEPS)]
        rounds += r.verify_steps
    return torch.tensor(out), accepted, rounds


def chi_square(expected_p: torch.Tensor, counts: torch.Tensor) -> tuple[float, int, float]:
    """Pearson's statistic over the cells of `expected_p` (flattened), cells with fewer than 5
    expected draws pooled into one; -> (statistic, degrees of freedom, p-value)."""
    n = counts.sum()
    e = expected_p.reshape(-1) * n
    o = counts.reshape(-1).double()
    small = e < 5
    e = torch.cat([e[~small], e[small].sum()[None]])
    o = torch.cat([o[~small], o[small].sum()[None]])
    keep = e > 0
    stat = float(((o[keep] - e[keep]) ** 2 / e[keep]).sum())
    df = int(keep.sum()) - 1
    return stat, df, float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def pair_counts(samples: torch.Tensor, i: int) -> torch.Tensor:
    return torch.bincount(samples[:, i] * V + samples[:, i + 1], minlength=V * V).view(V, V)


def pair_tables(J: torch.Tensor) -> list[torch.Tensor]:
    return [J.sum(2), J.sum(0)]  # (1st, 2nd), (2nd, 3rd)


def test_plain_sampling_matches_the_exact_distribution(models, exact):
    """The harness: plain sampling's draws pass the test against the computed distribution."""
    target, _ = models
    samples, _, _ = draws(PlainDecoder(target, set(), temperature=1.0, seed=7), N)
    for i, table in enumerate(pair_tables(exact)):
        stat, df, p = chi_square(table, pair_counts(samples, i))
        print(f"plain, tokens {i + 1}-{i + 2}: chi2 {stat:.1f}, df {df}, p {p:.3f}")
        assert p > SIGNIFICANCE, (i, stat, df, p)


@pytest.mark.parametrize("mode", ["sample", "argmax"])
def test_speculative_sampling_is_lossless(models, exact, mode):
    target, draft = models
    with SpecDecoder(target, draft, set(), steps=STEPS, temperature=1.0, seed=11, draft_sampling=mode) as sd:
        samples, accepted, rounds = draws(sd, N)
    print(f"{mode}: accepted per position {[round(a / rounds, 3) for a in accepted]} over {rounds} rounds")
    assert accepted[0] > 0.05 * rounds and accepted[1] > 0.01 * rounds  # accepted drafts and corrections both occur
    for i, table in enumerate(pair_tables(exact)):
        stat, df, p = chi_square(table, pair_counts(samples, i))
        print(f"{mode}, tokens {i + 1}-{i + 2}: chi2 {stat:.1f}, df {df}, p {p:.3f}")
        assert p > SIGNIFICANCE, (mode, i, stat, df, p)


def _first_round_q(sd: SpecDecoder, o0: int) -> torch.Tensor:
    """The draft's q (over target ids) for the first drafted token after the prompt and first token o0."""
    from eaglenest.evaluate.specdec import _new_cache, _Round

    _, aux = sd._target_forward(PROMPT, _new_cache(sd.target), keep=1)
    st = _Round(PROMPT)
    st.tokens.append(o0)
    sd._draft_extend(st, PROMPT[1:] + [o0], aux)
    return sd._q_target(torch.softmax(sd.draft.logits(st.h_last[0, -1]).float(), -1)).double()


def _no_residual_accept(p, q, token, generator=None):
    ok, tok = _correct_accept(p, q, token, generator)
    return (True, tok) if ok else (False, specdec.sample(p, generator))  # the bug: the replacement from p


_correct_accept = specdec.speculative_accept


def test_the_test_has_power_against_plausible_bugs_and_catches_one(models, exact, monkeypatch):
    target, draft = models
    J1 = exact.sum(2)  # (1st, 2nd)
    p0 = J1.sum(1)
    bugs = {"no residual": torch.zeros_like(J1), "p renormalized over the draft vocabulary": torch.zeros_like(J1)}
    in_draft = draft.t2d.double()
    with torch.no_grad(), SpecDecoder(target, draft, set(), steps=STEPS, temperature=1.0) as sd:
        for a in range(V):
            p, q = J1[a] / p0[a], _first_round_q(sd, a)
            residual = (p - q).clamp_min(0)
            bugs["no residual"][a] = p0[a] * (torch.minimum(p, q) + (1 - torch.minimum(p, q).sum()) * p)
            ph = p * in_draft / (p * in_draft).sum()
            bugs["p renormalized over the draft vocabulary"][a] = p0[a] * (
                torch.minimum(ph, q) + (1 - torch.minimum(ph, q).sum()) * residual / residual.sum())
    torch.manual_seed(3)  # the simulated experiments
    for name, B in bugs.items():
        sims = torch.distributions.Multinomial(N, probs=B.reshape(-1)).sample((2000,))
        power = sum(chi_square(J1, c)[2] < SIGNIFICANCE for c in sims) / len(sims)
        print(f"power against '{name}' (TV {0.5 * float((B - J1).abs().sum()):.3f}) at N={N}: {power:.3f}")
        assert power >= MIN_POWER[name], (name, power)
    # the first bug in the decoder itself: the same test rejects it
    monkeypatch.setattr(specdec, "speculative_accept", _no_residual_accept)
    with SpecDecoder(target, draft, set(), steps=STEPS, temperature=1.0, seed=11) as sd:
        samples, _, _ = draws(sd, N)
    stat, df, p = chi_square(J1, pair_counts(samples, 0))
    print(f"decoder without the residual: chi2 {stat:.1f}, df {df}, p {p:.2e}")
    assert p < SIGNIFICANCE
