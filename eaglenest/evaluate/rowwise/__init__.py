"""Row-wise forwards: what exact verification (evaluate/verification.py) installs on a transformers
target so that each row of a verification forward is computed as plain decoding computes that token
alone, whatever the other rows are.

  attention.py  each query row its own single-query SDPA call over the keys it may see;
  linears.py    a Linear row by row (torch's one-row call), or in the row-invariant gemv kernel
                (native/gemv.py); the GEMM of long prefills;
  moe.py        a mixture-of-experts block token by token.

Each replaces a module's forward (an instance attribute; None restores the class's) for forwards of
up to max_rows rows (num_draft_tokens), and leaves longer ones (prompt prefills, which plain and
speculative decoding share) batched.  Where a replacement is needed is the probe's decision
(verification.py), not theirs.
"""

from __future__ import annotations

import functools

import torch


def rows(x: torch.Tensor) -> int:
    """The rows of a [..., K] input (the tokens of a batch-1 forward)."""
    return x.numel() // x.shape[-1] if x.numel() else 0


def each_row(fn, x: torch.Tensor) -> torch.Tensor:
    """fn applied to each row of x alone, shaped as plain decoding feeds it ([1, 1, K]), joined back."""
    n = rows(x)
    flat = x.reshape(n, 1, x.shape[-1])
    out = torch.cat([fn(flat[i : i + 1]) for i in range(n)])
    return out.reshape(*x.shape[:-1], out.shape[-1])


def set_forward(module: torch.nn.Module, how, max_rows: int | None) -> None:
    """module's forward becomes how(module, max_rows, x); None: the class's own forward again."""
    if max_rows is None:
        module.__dict__.pop("forward", None)
    else:
        module.forward = functools.partial(how, module, max_rows)
