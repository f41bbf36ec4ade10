"""DFlash speculative decoding: one draft forward proposes a whole block, the target verifies it.

The round loop, the verification forward (with its exactness set-up, verification.py), the acceptance
rules (greedy walk; temperature > 0: the standard min(1, p/q) rule with the residual) and the
cache bookkeeping are `SpecDecoder`'s (specdec.py): a DFlash block is a chain of block_size - 1
drafted tokens.  Only the two draft-side pieces differ:

  * `_draft_extend`: the draft's cache holds, per draft layer, the context keys/values of every
    committed position whose target states are known (positions 0..L-2 between rounds, the same
    invariant as the EAGLE-3 step-0 entries); each round appends those of the accepted path, from
    the aux states the verification forward captured;
  * `propose`: the block [x_{L-1}, MASK x (block_size - 1)] at positions L-1 .. L-2+block_size
    attends to the whole context cache and to itself (non-causal), and slot k proposes x_{L-1+k}:
    its argmax (greedy) or a sample from its distribution q_k, which then judges the token in the
    acceptance rule (a block's q_k does not depend on the tokens drafted before it, a special case
    of the rule's draft distribution, so sampling stays lossless).
"""

from __future__ import annotations

import torch

from eaglenest.evaluate.specdec import Proposal, SpecDecoder, sample


class DFlashDecoder(SpecDecoder):
    """`DFlashDecoder(target, draft, eos_ids, temperature=..., seed=...)`: draft = a DFlashDraft."""

    def __init__(self, target, draft, eos_ids: set[int], temperature: float = 0.0, seed: int = 0):
        super().__init__(target, draft, eos_ids, steps=draft.cfg.block_size - 1, topk=1, temperature=temperature, seed=seed)

    def _draft_extend(self, st, next_tokens: list[int], feats: torch.Tensor) -> None:
        """Context keys/values for the newly committed positions (their target states `feats`)."""
        d = self.draft
        ctx = getattr(st, "ctx", None)
        n_old = 0 if ctx is None else ctx[0][0].shape[2]
        pos = torch.arange(n_old, n_old + feats.shape[0], device=self.device)[None]
        new = d.context_kv(d.fuse(feats[None]), pos)
        st.ctx = new if ctx is None else [(torch.cat([k0, k], 2), torch.cat([v0, v], 2)) for (k0, v0), (k, v) in zip(ctx, new)]

    def propose(self, st) -> Proposal:
        d, S = self.draft, self.draft.cfg.block_size
        Lc = st.ctx[0][0].shape[2]  # = L-1: the anchor x_{L-1} sits at position Lc
        block = d.block_input(torch.tensor([[st.tokens[-1]]], device=self.device))  # [1, 1, S]
        pos = (Lc + torch.arange(S, device=self.device))[None, None]
        h = d.blocks(block, pos, st.ctx, torch.tensor([[Lc]], device=self.device))
        logits = d.logits(h[0, 0, 1:]).float()  # [S-1, draft vocab]
        q = None
        if self.temperature > 0:
            pd = torch.softmax(logits / self.temperature, dim=-1)
            di = [sample(pd[k], self.generator) for k in range(S - 1)]
            q = self._q_target(pd)
        else:
            di = logits.argmax(-1).tolist()
        tokens = self.draft_to_target[torch.tensor(di, device=self.device)].tolist()
        return Proposal(tokens, list(range(-1, S - 2)), list(range(1, S)), q)
