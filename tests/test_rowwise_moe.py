"""Mixture-of-experts blocks token by token (evaluate/rowwise/moe.py): which modules are blocks, each
token of a verification-sized forward run through the block alone, plain decoding and prefills as
the block runs them, and a block whose output cannot be joined refused by name.

A toy block whose tokens see each other (as routed experts' grouped GEMMs make them do) shows which
way a forward went on any CPU.  On real MoE classes: tests/test_family_deepseek.py."""

from __future__ import annotations

import pytest
import torch

from eaglenest import EaglenestError
from eaglenest.evaluate.rowwise.moe import moe_blocks, set_block_rowwise


class _Block(torch.nn.Module):
    """A router `gate` next to its `experts`; each token's output gets the mean of the forward's tokens."""

    def __init__(self):
        super().__init__()
        self.gate, self.experts = torch.nn.Linear(4, 2), torch.nn.Identity()

    def forward(self, x):
        return x + x.mean(dim=-2, keepdim=True)


def test_moe_blocks_are_the_modules_with_a_gate_and_experts():
    m = torch.nn.ModuleDict({"mlp": _Block(), "dense": torch.nn.Sequential(torch.nn.Linear(4, 4)),
                             "deep": torch.nn.ModuleDict({"moe": _Block()})})
    m.gate_only = torch.nn.Module()
    m.gate_only.gate = torch.nn.Linear(4, 2)
    assert set(moe_blocks(m)) == {"mlp", "deep.moe"}


def test_a_block_runs_each_token_alone_in_verification_sized_forwards():
    b = _Block()
    set_block_rowwise(b, 4)
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 4, 5):
        x = torch.randn(1, n, 4, generator=g)
        alone = torch.cat([_Block.forward(b, x[:, i : i + 1]) for i in range(n)], dim=1)
        if n <= 4:  # plain decoding's token, and verification's: each token as if alone
            assert torch.equal(b(x), alone), n
        else:  # a prefill: the block as it runs, its tokens together
            assert torch.equal(b(x), _Block.forward(b, x)) and not torch.equal(b(x), alone)
    set_block_rowwise(b, None)
    x = torch.randn(1, 3, 4, generator=g)
    assert "forward" not in b.__dict__ and torch.equal(b(x), _Block.forward(b, x))


def test_an_moe_block_returning_a_tuple_is_refused_by_name():
    class TupleMoe(torch.nn.Module):  # like transformers' Zaya / Ernie-4.5-VL blocks: (states, router output)
        def __init__(self):
            super().__init__()
            self.gate, self.experts = torch.nn.Linear(4, 2), torch.nn.Identity()

        def forward(self, x):
            return x, self.gate(x)

    b = TupleMoe()
    set_block_rowwise(b, 4)
    assert b(torch.ones(1, 1, 4))[0].shape == (1, 1, 4)  # one row: the block as it is
    with pytest.raises(EaglenestError, match="TupleMoe returns tuple"):
        b(torch.ones(1, 3, 4))
