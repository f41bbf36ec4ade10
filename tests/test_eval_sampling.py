"""The speculative rejection-sampling rules emit tokens distributed exactly as the target's p."""

from __future__ import annotations

import torch

from eaglenest.evaluate.specdec import accept_among_candidates, speculative_accept

N = 20_000


def _tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - p).abs().sum())


def test_speculative_accept_preserves_p():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.05, 0.40, 0.25, 0.20, 0.10, 0.00])
    q = torch.tensor([0.30, 0.10, 0.25, 0.05, 0.10, 0.20])  # q puts mass where p has none
    counts = torch.zeros(6)
    accepted = 0
    for _ in range(N):
        d = int(torch.multinomial(q, 1, generator=g))
        ok, tok = speculative_accept(p, q, d, g)
        counts[tok] += 1
        accepted += ok
    assert _tv(counts, p) < 0.02
    assert counts[5] == 0  # never emits a token p rules out
    # acceptance rate of the standard rule is sum(min(p, q))
    assert abs(accepted / N - float(torch.minimum(p, q).sum())) < 0.02


def test_speculative_accept_identical_distributions_always_accept():
    g = torch.Generator().manual_seed(1)
    p = torch.tensor([0.5, 0.3, 0.2])
    assert all(speculative_accept(p, p.clone(), int(torch.multinomial(p, 1, generator=g)), g)[0] for _ in range(500))


def test_candidates_rule_preserves_p():
    g = torch.Generator().manual_seed(2)
    p = torch.tensor([0.10, 0.35, 0.05, 0.30, 0.20])
    counts = torch.zeros(5)
    first = 0
    for _ in range(N):
        i, tok = accept_among_candidates(p, [3, 0, 4], g)  # deterministic top-k style siblings
        counts[tok] += 1
        first += i == 0
        if i is not None:
            assert tok == [3, 0, 4][i]
    assert _tv(counts, p) < 0.02
    assert abs(first / N - 0.30) < 0.02  # the first candidate is accepted with probability p(c)


def test_candidates_rule_covering_all_mass():
    g = torch.Generator().manual_seed(3)
    p = torch.tensor([0.0, 0.6, 0.4])
    counts = torch.zeros(3)
    for _ in range(4000):
        i, tok = accept_among_candidates(p, [2, 1], g)
        assert i is not None
        counts[tok] += 1
    assert _tv(counts, p) < 0.03
