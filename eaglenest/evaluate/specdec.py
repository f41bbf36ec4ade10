"""EAGLE-3 speculative decoding over a transformers target (batch size 1), and the plain baseline.

Index bookkeeping (exactly how the draft was trained, see eaglenest/train/ttt.py):
  committed tokens x_0..x_{L-1}; f_t = concat of the target's aux states at position t.
  A draft *step-0 entry* at index t takes token x_{t+1} and hidden fuse(f_t) at rope position t
  and predicts x_{t+2}.  Invariant between rounds: the target's KV cache holds positions
  0..L-2 (x_{L-1}, the newest token, has not been fed yet) and the draft's KV cache holds the
  step-0 entries of indices 0..L-2 (x_{L-1} was their last input token).  So both caches have
  L-1 entries, and the draft's newest output h2 predicts x_L.  What a draft step caches per
  position is the draft's concern (K and V, or MLA's latent: `draft.model.cache_append`), and what
  it hands the next step is `draft.feedback(h2)` (h2, or norm(h2) with norm_output): the same
  method the training loop uses.

One round:
  1. draft: from that newest output, propose a chain (topk=1: steps S tokens d_1..d_S) or a
     tree (topk>1: SGLang's beam expansion, the best num_draft_tokens-1 nodes).  A node at depth
     j is fed back to the draft at position (L-2)+j with feedback(the previous step's output),
     attending to the whole draft cache plus its own ancestors of this round;
  2. target: one forward over [x_{L-1}, nodes...] with the KV cache (a 4-D ancestor mask for a
     tree), capturing the aux states with forward pre-hooks (no output_hidden_states);
  3. accept the longest matching path (greedy) or apply rejection sampling, append the
     bonus/correction token, cut the target cache back to the accepted path, throw away the
     draft's entries of this round, and add draft step-0 entries for the newly committed
     indices from the aux states the verification forward already produced.

The same code path does the first round: the prefill forward gives f_0..f_{n-1} and x_n, and the
draft's "extend" computes step-0 entries 0..n-1 in one forward.

tau = tokens emitted by verification forwards / verification forwards (bonus included).  The
first new token comes from the prefill forward, which verifies nothing, so it is not counted
(an always-wrong draft gives exactly 1.0; a perfect chain draft gives steps+1, except where
the end of the answer truncates the last round).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from eaglenest import EaglenestError
from eaglenest.draft.model import cache_append, cache_length
from eaglenest.models.target import decoder_layers

# ----------------------------------------------------------------------------------------------
# results


@dataclass
class GenResult:
    """One generation.  For the plain decoder verify_steps counts its decode forwards."""

    output_ids: list[int]
    prompt_tokens: int
    verify_steps: int = 0
    verified_tokens: int = 0  # tokens emitted by verification forwards (all but the prefill's)
    accepted_per_position: list[int] = field(default_factory=list)  # [S]: steps where draft pos i was accepted
    wall_s: float = 0.0
    finish_reason: str = "length"  # "stop" (an eos/end-of-turn token) or "length"
    draft_s: float = 0.0  # of wall_s: in the draft (proposals and its cache updates), the drafting cost

    @property
    def tau(self) -> float | None:
        return self.verified_tokens / self.verify_steps if self.verify_steps else None


# ----------------------------------------------------------------------------------------------
# sampling rules (public: unit-tested on toy distributions; the decoder as a whole: tests/test_lossless.py)

# How a chain (topk 1) is drafted at temperature > 0: "sample" draws each token from the draft's q
# and verifies it with min(1, p/q) (standard speculative sampling; accepted with probability
# sum_v min(p_v, q_v); vLLM's draft_sample_method=probabilistic); "argmax" proposes q's argmax and
# verifies it as a deterministic candidate (accepted with probability p(token); SGLang's chain and
# vLLM's default).  Trees (topk > 1) always propose top-k candidates.  Both are lossless.
DRAFT_SAMPLING = ("sample", "argmax")


def sample(p: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(p, 1, generator=generator))


def _uniform(generator: torch.Generator | None, device) -> float:
    return float(torch.rand((), generator=generator, device=device))


def speculative_accept(p: torch.Tensor, q: torch.Tensor, token: int, generator=None) -> tuple[bool, int]:
    """The standard speculative-sampling rule for one drafted `token` drawn from q.

    Accept with probability min(1, p(token)/q(token)); on rejection draw the replacement from
    norm(max(0, p - q)).  The emitted token is then distributed exactly as p.
    Returns (accepted, emitted token).
    """
    pt, qt = float(p[token]), float(q[token])
    if qt <= 0.0 or _uniform(generator, p.device) * qt < pt:  # u < p/q without dividing by zero
        return True, token
    residual = (p - q).clamp_min_(0.0)
    if float(residual.sum()) <= 0.0:  # p == q up to rounding: any sample from p is right
        residual = p
    return False, sample(residual, generator)


def accept_among_candidates(p: torch.Tensor, candidates: list[int], generator=None) -> tuple[int | None, int]:
    """Rejection sampling against *deterministic* proposals (tree siblings from the draft's top-k).

    Try the candidates in order; candidate c is accepted with probability r(c) where r is the
    target distribution with the already-rejected candidates removed and renormalized.  If all
    are rejected, draw from r.  This is sequential sampling from p, so the emitted token is
    exactly p-distributed (SGLang's "target-only" tree sampling, i.e. the standard rule with
    q = one-hot on each candidate).  Returns (index of the accepted candidate or None, token).
    """
    r = p.clone()
    mass = float(r.sum())
    for i, c in enumerate(candidates):
        pc = float(r[c])
        if mass > 0 and _uniform(generator, p.device) * mass < pc:
            return i, c
        r[c] = 0.0
        mass -= pc
    if float(r.sum()) <= 0.0:  # every token with mass was a candidate (numerically): fall back to p
        r = p
    return None, sample(r, generator)


# ----------------------------------------------------------------------------------------------
# target-side helpers shared by both decoders


def _new_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def _keep_cache_entries(cache, start: int, keep: list[int], total_new: int) -> None:
    """Cut a DynamicCache that grew by `total_new` entries after `start` back to `start` + the
    new entries at relative indices `keep` (sorted).  A contiguous prefix (every chain, and a
    tree whose accepted path is its first nodes) is a cheap crop; otherwise gather."""
    drop = total_new - len(keep)
    if keep == list(range(len(keep))):
        if drop:
            cache.crop(-drop)
        return
    idx = torch.tensor([start + i for i in keep], device=cache.layers[0].keys.device)
    for layer in cache.layers:
        layer.keys = torch.cat([layer.keys[..., :start, :], layer.keys.index_select(-2, idx)], dim=-2)
        layer.values = torch.cat([layer.values[..., :start, :], layer.values.index_select(-2, idx)], dim=-2)


def tree_verify_inputs(Lt: int, parents: list[int], depths: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(position_ids [1, n+1], 4-D bool mask [1, 1, n+1, Lt+n+1]) of a tree verification forward:
    the root at position Lt, node i at Lt + depth; each row sees the prefix, its ancestors and itself."""
    n = len(parents)
    tree = torch.zeros(n + 1, n + 1, dtype=torch.bool, device=device)
    tree[:, 0] = True
    for i, p in enumerate(parents, start=1):
        tree[i] = tree[p + 1]
        tree[i, i] = True
    mask = torch.cat([torch.ones(n + 1, Lt, dtype=torch.bool, device=device), tree], dim=1)
    pos = torch.tensor([[Lt] + [Lt + d for d in depths]], device=device)
    return pos, mask[None, None]


def _first_stop(tokens: list[int], eos: set[int], room: int) -> tuple[list[int], bool]:
    """Truncate new tokens at the first eos (kept) and at `room` tokens; (kept, stopped_by_eos)."""
    for i, t in enumerate(tokens[:room]):
        if t in eos:
            return tokens[: i + 1], True
    return tokens[:room], False


# ----------------------------------------------------------------------------------------------
# plain decoding (the baseline, and the reference for greedy equivalence)


class PlainDecoder:
    """Greedy/sampled decoding of the target alone with the same KV-cache loop as SpecDecoder."""

    def __init__(self, target, eos_ids: set[int], temperature: float = 0.0, seed: int = 0):
        self.target = target
        self.eos = set(eos_ids)
        self.temperature = float(temperature)
        self.device = next(target.parameters()).device
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    def _pick(self, logits: torch.Tensor) -> int:
        if self.temperature <= 0:
            return int(logits.argmax())
        return sample(torch.softmax(logits.float() / self.temperature, -1), self.generator)

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> GenResult:
        t0 = time.perf_counter()
        cache = _new_cache(self.target)
        ids = torch.tensor([prompt_ids], device=self.device)
        logits = self.target(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        out = [self._pick(logits[0, -1])]
        steps = 0
        reason = "stop" if out[-1] in self.eos else "length"
        pos = len(prompt_ids)
        while reason != "stop" and len(out) < max_new_tokens:
            x = torch.tensor([[out[-1]]], device=self.device)
            p = torch.tensor([[pos]], device=self.device)
            logits = self.target(input_ids=x, position_ids=p, past_key_values=cache, use_cache=True).logits
            steps += 1
            pos += 1
            out.append(self._pick(logits[0, -1]))
            if out[-1] in self.eos:
                reason = "stop"
        return GenResult(out, len(prompt_ids), verify_steps=steps, verified_tokens=len(out) - 1,
                         wall_s=time.perf_counter() - t0, finish_reason=reason)


# ----------------------------------------------------------------------------------------------
# the draft's proposal for one round


@dataclass
class Proposal:
    """Draft nodes of one round, parents before children.

    tokens[i] (target id) sits at depth depths[i] (1 = guess of x_L); parents[i] is the index of
    its parent node or -1 for the root (x_{L-1}).  `q` [n, V] is the draft distribution each
    token was *sampled* from (chain sampling only; None for argmax/top-k proposals).
    """

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    q: torch.Tensor | None = None
    scores: list[float] | None = None  # cumulative draft log-probs (tree proposals)

    @property
    def is_chain(self) -> bool:
        return self.parents == list(range(-1, len(self.tokens) - 1))


class _Round:
    """Per-generation mutable state (what a monkeypatched proposal may look at: `tokens`)."""

    def __init__(self, prompt_ids: list[int]):
        self.tokens: list[int] = list(prompt_ids)  # committed x_0..x_{L-1}
        self.draft_cache: tuple | None = None  # the draft's decoding cache, step-0 entries 0..L-2
        self.h_last: torch.Tensor | None = None  # [1, 1, H] output h2 (pre-norm) of entry L-2


class SpecDecoder:
    """EAGLE-3 speculative decoding: `SpecDecoder(target, draft, ...).generate(prompt_ids, n)`.

    target: a transformers causal LM (Llama-like: `.model.layers`, accepts `past_key_values`,
    `position_ids`, a 4-D `attention_mask` and `logits_to_keep`).  draft: an Eagle3Draft whose
    `embed_tokens` are the target's input embeddings and whose dtype/device match the target.
    """

    def __init__(
        self,
        target,
        draft,
        eos_ids: set[int],
        steps: int = 3,
        topk: int = 1,
        num_draft_tokens: int | None = None,
        temperature: float = 0.0,
        seed: int = 0,
        draft_sampling: str = "sample",
    ):
        if steps < 1:
            raise EaglenestError(f"--steps must be >= 1 (got {steps})")
        if topk < 1:
            raise EaglenestError(f"--topk must be >= 1 (got {topk})")
        self.num_draft_tokens = resolve_num_draft_tokens(steps, topk, num_draft_tokens)
        self.target, self.draft = target, draft
        self.steps, self.topk = steps, topk
        self.temperature = float(temperature)
        if draft_sampling not in DRAFT_SAMPLING:
            raise EaglenestError(f"--draft-sampling must be one of {', '.join(DRAFT_SAMPLING)} (got {draft_sampling})")
        self.draft_sampling = draft_sampling
        self.eos = set(eos_ids)
        self.device = next(target.parameters()).device
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.aux_ids = list(draft.cfg.aux_layer_ids)
        # target id of every draft id, and the target vocabulary size (for q over target ids)
        self.draft_to_target = (torch.arange(draft.d2t.numel(), device=draft.d2t.device) + draft.d2t).to(self.device)
        self.vocab_size = int(target.config.vocab_size)
        # capture-before aux states: a pre-hook on decoder layer k sees hidden_states[k]
        self._captured: dict[int, torch.Tensor] = {}
        self._capturing = False
        self.last_round: _Round | None = None
        layers = decoder_layers(target)
        self._hooks = [layers[k].register_forward_pre_hook(self._hook(k), with_kwargs=True) for k in self.aux_ids]

    def _hook(self, k: int):
        def hook(module, args, kwargs):
            if self._capturing:
                self._captured[k] = args[0] if args else kwargs["hidden_states"]

        return hook

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- target ------------------------------------------------------------------------------
    def _target_forward(self, ids: list[int], cache, position_ids=None, mask=None, keep: int = 0):
        """-> (logits [T or keep, V], aux states [T, 3H]) for one sequence, extending `cache`."""
        x = torch.tensor([ids], device=self.device)
        self._captured.clear()
        self._capturing = True
        try:
            out = self.target(input_ids=x, position_ids=position_ids, attention_mask=mask,
                              past_key_values=cache, use_cache=True, logits_to_keep=keep)
        finally:
            self._capturing = False
        aux = torch.cat([self._captured[k][0] for k in self.aux_ids], dim=-1)
        self._captured.clear()
        return out.logits[0], aux

    def _target_probs(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits.float() / self.temperature, dim=-1)

    def _pick(self, logits: torch.Tensor) -> int:
        if self.temperature <= 0:
            return int(logits.argmax())
        return sample(self._target_probs(logits), self.generator)

    # --- draft -------------------------------------------------------------------------------
    def _draft_extend(self, st: _Round, next_tokens: list[int], feats: torch.Tensor) -> None:
        """Add step-0 entries for the newly committed indices: entry t takes x_{t+1} and f_t."""
        d = self.draft
        n_old = cache_length(st.draft_cache)
        m = len(next_tokens)
        ids = torch.tensor([next_tokens], device=self.device)
        pos = torch.arange(n_old, n_old + m, device=self.device)[None]
        mask = None
        if m > 1:  # causal among the new entries, everything old visible
            mask = torch.ones(m, n_old + m, dtype=torch.bool, device=self.device).tril(n_old)[None]
        h, new = d.step(ids, d.fuse(feats[None]), pos, past_kv=st.draft_cache, mask=mask)
        st.draft_cache = cache_append(st.draft_cache, new)
        st.h_last = h[:, -1:]

    def _draft_logprobs(self, h: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.draft.logits(h).float(), dim=-1)

    def _q_target(self, draft_probs: torch.Tensor) -> torch.Tensor:
        """Draft-vocab probabilities [.., Vd] -> the same distribution over target ids [.., V]."""
        q = torch.zeros(*draft_probs.shape[:-1], self.vocab_size, device=draft_probs.device)
        q[..., self.draft_to_target] = draft_probs
        return q

    def propose(self, st: _Round) -> Proposal:
        """The draft's nodes for this round (tests monkeypatch this to rig acceptance)."""
        if self.topk == 1:
            return self._propose_chain(st)
        return self._propose_tree(st)

    def _propose_chain(self, st: _Round) -> Proposal:
        d, S = self.draft, self.steps
        base = cache_length(st.draft_cache) - 1  # index (and position) of the newest step-0 entry
        cache, h = st.draft_cache, st.h_last
        tokens, qs = [], []
        for j in range(S):
            logits = d.logits(h[0, -1]).float()
            if self.temperature > 0 and self.draft_sampling == "sample":
                pd = torch.softmax(logits / self.temperature, dim=-1)
                di = sample(pd, self.generator)
                qs.append(pd)
            else:
                di = int(logits.argmax())
            tok = int(self.draft_to_target[di])
            tokens.append(tok)
            if j == S - 1:
                break
            # feed the drafted token back: position base+j+1, the previous step's feedback state
            ids = torch.tensor([[tok]], device=self.device)
            pos = torch.tensor([[base + j + 1]], device=self.device)
            h, new = d.step(ids, d.feedback(h), pos, past_kv=cache)
            cache = cache_append(cache, new)
        q = self._q_target(torch.stack(qs)) if qs else None
        return Proposal(tokens, list(range(-1, S - 1)), list(range(1, S + 1)), q)

    def _propose_tree(self, st: _Round) -> Proposal:
        """SGLang-style EAGLE tree: expand the top-k of each of the k best frontier nodes per step,
        score nodes by cumulative draft log-prob, keep the best num_draft_tokens-1."""
        d, K, S = self.draft, self.topk, self.steps
        dev = self.device
        Lc = cache_length(st.draft_cache)
        base = Lc - 1
        lp, di = self._draft_logprobs(st.h_last[0, -1]).topk(K)
        # all nodes ever created (creation order puts parents first)
        tokens: list[int] = self.draft_to_target[di].tolist()
        parents: list[int] = [-1] * K
        depths: list[int] = [1] * K
        scores: list[torch.Tensor] = [lp]
        frontier = list(range(K))  # nodes to feed back this step
        hidden = d.feedback(st.h_last).expand(1, K, -1)  # what each frontier node's parent hands on
        slot: dict[int, int] = {}  # node -> its cache slot among this round's draft entries
        cache = st.draft_cache
        n_slots = 0
        for step in range(1, S):
            # ancestor mask: all committed entries, plus each node's fed-back ancestors and itself
            mask = torch.zeros(K, Lc + n_slots + K, dtype=torch.bool, device=dev)
            mask[:, :Lc] = True
            for r, node in enumerate(frontier):
                a = parents[node]
                while a >= 0:
                    mask[r, Lc + slot[a]] = True
                    a = parents[a]
                mask[r, Lc + n_slots + r] = True
            ids = torch.tensor([[tokens[n] for n in frontier]], device=dev)
            pos = torch.full((1, K), base + step, device=dev)
            h, new = d.step(ids, hidden, pos, past_kv=cache, mask=mask[None])
            cache = cache_append(cache, new)
            for r, node in enumerate(frontier):
                slot[node] = n_slots + r
            n_slots += K
            # expand: top-k children of every frontier node, cumulative scores
            lp, di = self._draft_logprobs(h[0]).topk(K, dim=-1)  # [K, K]
            front_scores = torch.stack([_score_of(scores, n, K) for n in frontier])
            cand = (front_scores[:, None] + lp).reshape(-1)  # [K*K]
            first = len(tokens)
            tokens += self.draft_to_target[di.reshape(-1)].tolist()
            parents += [frontier[i // K] for i in range(K * K)]
            depths += [step + 1] * (K * K)
            scores.append(cand)
            if step == S - 1:
                break
            best = cand.topk(K).indices.tolist()
            frontier = [first + b for b in best]
            hidden = d.feedback(h)[:, [b // K for b in best]]
        # keep the best n-1 nodes; a stable sort on -score keeps each parent ahead of its
        # children (a child's score can never exceed its parent's: log-probs are <= 0)
        all_scores = torch.cat(scores)
        order = torch.sort(-all_scores, stable=True).indices[: self.num_draft_tokens - 1].tolist()
        order.sort(key=lambda n: (depths[n], n))  # by depth, then creation: parents still first
        new_index = {n: i for i, n in enumerate(order)}
        return Proposal(
            [tokens[n] for n in order],
            [new_index[parents[n]] if parents[n] >= 0 else -1 for n in order],
            [depths[n] for n in order],
            None,
            [float(all_scores[n]) for n in order],
        )

    # --- one generation ------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> GenResult:
        t0 = time.perf_counter()
        if not prompt_ids:
            raise EaglenestError("empty prompt")
        st = _Round(prompt_ids)
        cache = _new_cache(self.target)
        res = GenResult([], len(prompt_ids), accepted_per_position=[0] * self.steps)
        # prefill: f_0..f_{n-1} and x_n
        logits, aux = self._target_forward(prompt_ids, cache, keep=1)
        first = self._pick(logits[-1])
        out = [first]
        st.tokens.append(first)
        if first in self.eos or max_new_tokens <= 1:
            res.finish_reason = "stop" if first in self.eos else "length"
        else:
            t = time.perf_counter()
            self._draft_extend(st, prompt_ids[1:] + [first], aux)
            res.draft_s += time.perf_counter() - t
            while True:
                new, feats_for_next = self._round(st, cache, res)
                new, stopped = _first_stop(new, self.eos, max_new_tokens - len(out))
                out += new
                res.verified_tokens += len(new)
                st.tokens += new
                if stopped or len(out) >= max_new_tokens:
                    res.finish_reason = "stop" if stopped else "length"
                    break
                # step-0 entries for the committed indices: token after each path node, its f
                t = time.perf_counter()
                self._draft_extend(st, new, feats_for_next)
                res.draft_s += time.perf_counter() - t
        res.output_ids = out
        self.last_round = st  # kept for inspection (tests check the draft cache against a recompute)
        res.wall_s = time.perf_counter() - t0
        return res

    def _round(self, st: _Round, cache, res: GenResult) -> tuple[list[int], torch.Tensor]:
        """Draft, verify, accept; -> (new committed tokens, aux states of the accepted path)."""
        t = time.perf_counter()
        prop = self.propose(st)
        res.draft_s += time.perf_counter() - t
        n = len(prop.tokens)
        Lt = cache.get_seq_length()  # = L-1: position of the root x_{L-1}
        ids = [st.tokens[-1]] + prop.tokens
        if prop.is_chain:
            logits, aux = self._target_forward(ids, cache)  # causal mask made by transformers
        else:
            pos, mask = tree_verify_inputs(Lt, prop.parents, prop.depths, self.device)
            logits, aux = self._target_forward(ids, cache, position_ids=pos, mask=mask)
        path, new = self._accept(prop, logits)
        res.verify_steps += 1
        for i in range(len(path) - 1):
            res.accepted_per_position[i] += 1
        _keep_cache_entries(cache, Lt, path, n + 1)
        return new, aux[path]

    def _accept(self, prop: Proposal, logits: torch.Tensor) -> tuple[list[int], list[int]]:
        """Walk the tree from the root -> (accepted verify-input indices incl. root 0, new tokens).

        Greedy: follow the child equal to the target's argmax.  Sampling: chain proposals drawn
        from q use the standard min(1, p/q) rule; top-k tree siblings use the deterministic-
        candidate rule (accept_among_candidates).  The bonus/correction token ends the walk."""
        children: dict[int, list[int]] = {}
        for i, p in enumerate(prop.parents, start=1):
            children.setdefault(p + 1, []).append(i)
        path, new, cur = [0], [], 0
        if self.temperature <= 0:
            am = logits.argmax(-1).tolist()  # one sync for all positions
            while True:
                want = am[cur]
                nxt = next((c for c in children.get(cur, []) if prop.tokens[c - 1] == want), None)
                new.append(want)
                if nxt is None:
                    return path, new
                path.append(nxt)
                cur = nxt
        while True:
            p = self._target_probs(logits[cur])
            kids = children.get(cur, [])
            if not kids:
                new.append(sample(p, self.generator))  # bonus
                return path, new
            if prop.q is not None:  # chain drafted by sampling from q
                c = kids[0]
                ok, tok = speculative_accept(p, prop.q[c - 1], prop.tokens[c - 1], self.generator)
                new.append(tok)
                if not ok:
                    return path, new
            else:
                i, tok = accept_among_candidates(p, [prop.tokens[c - 1] for c in kids], self.generator)
                new.append(tok)
                if i is None:
                    return path, new
                c = kids[i]
            path.append(c)
            cur = c


def _score_of(scores: list[torch.Tensor], node: int, K: int) -> torch.Tensor:
    """Cumulative score of a node from the per-step score tensors (K, then K*K per step)."""
    if node < K:
        return scores[0][node]
    j, r = divmod(node - K, K * K)
    return scores[1 + j][r]


def resolve_num_draft_tokens(steps: int, topk: int, num_draft_tokens: int | None) -> int:
    """Default and validate the verification budget (root included, as in SGLang)."""
    if topk == 1:
        if num_draft_tokens not in (None, steps + 1):
            raise EaglenestError(
                f"with --topk 1 the chain verifies exactly --steps draft tokens: --num-draft-tokens must be "
                f"steps+1 = {steps + 1} (got {num_draft_tokens})"
            )
        return steps + 1
    most = 1 + topk + (steps - 1) * topk * topk  # every node the expansion creates, plus the root
    if num_draft_tokens is None:
        return min(steps * topk + 1, most)
    if not 2 <= num_draft_tokens <= most:
        raise EaglenestError(
            f"--num-draft-tokens must be in 2..{most} for --steps {steps} --topk {topk} (got {num_draft_tokens})"
        )
    return num_draft_tokens
