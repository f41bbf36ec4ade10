"""Mixture-of-experts blocks token by token.  A block routes a forward's tokens to its experts in
groups, so a token's expert GEMMs have as many rows as tokens chose that expert in the same forward:
which other tokens are verified with it decides its arithmetic.  The experts are 3-D weights called
through F.linear, which no Linear-module fix (linears.py) reaches, so the whole block runs each token
alone in forwards of 2..max_rows rows; its output for a token depends on that token only.
"""

from __future__ import annotations

import torch

from eaglenest.evaluate.rowwise import each_row, rows, set_forward


def moe_blocks(model) -> dict[str, torch.nn.Module]:
    """The model's mixture-of-experts blocks: a router `gate` next to its `experts` (DeepSeek-V2/V3,
    Kimi-K2, Qwen2/3-MoE, Mixtral in transformers 5)."""
    return {n: m for n, m in model.named_modules() if hasattr(m, "experts") and hasattr(m, "gate")}


def _block_by_rows(module: torch.nn.Module, max_rows: int, x: torch.Tensor) -> torch.Tensor:
    forward = type(module).forward.__get__(module)  # the class's own forward, under the one installed here
    if not 1 < rows(x) <= max_rows:  # plain decoding and long prefills: the block as it is
        return forward(x)

    def one(r: torch.Tensor) -> torch.Tensor:
        out = forward(r)
        if not isinstance(out, torch.Tensor):  # e.g. (states, router logits): not a block this knows how to join
            from eaglenest import EaglenestError

            raise EaglenestError(f"exact verification: the mixture-of-experts block {type(module).__name__} returns "
                                 f"{type(out).__name__}, not a tensor of states, so it cannot be run token by token; "
                                 "--attention model keeps the model's own forward (exactness then only probed)")
        return out

    return each_row(one, x)


def set_block_rowwise(module: torch.nn.Module, max_rows: int | None) -> None:
    """Run a token-wise block (an MoE block: each token's output depends on that token alone) one
    token at a time in forwards of 2..max_rows rows (None: as it is again)."""
    set_forward(module, _block_by_rows, max_rows)
