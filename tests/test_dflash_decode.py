"""DFlash decoding over the tiny random Llama: greedy == plain greedy (where the probe finds
verification exact), an oracle block accepted whole (tau = block_size), the context cache against
a full recompute, tau accounting, sampling; the same verification code as EAGLE-3 (specdec.py)."""

from __future__ import annotations

import pytest
import torch
from helpers_eval import oracle_chain, plain_greedy
from test_eval_specdec import exact_tiny, tiny, tiny_verified  # noqa: F401 -- shared fixtures

from eaglenest.draft import draft_model
from eaglenest.draft.dflash import DFlashConfig
from eaglenest.draft.vocab import build_vocab
from eaglenest.evaluate.dflash import DFlashDecoder
from eaglenest.evaluate.specdec import PlainDecoder

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[1, 500, 600, 700, 800], [1, 9690, 198, 2683, 359, 253], [1, 42]]
N_NEW = 24
BLOCKS = [4, 7]


def random_dflash(target, block: int, layers: int = 2, draft_vocab: int = 4096, seed: int = 0):
    cfg_t = target.config
    cfg = DFlashConfig.from_target(cfg_t, draft_vocab, [2, 4, 6, 7], block_size=block, num_hidden_layers=layers,  # four target layers
                                   mask_token_id=16)
    torch.manual_seed(seed)
    d = draft_model(cfg, embed_weight=target.get_input_embeddings().weight)
    g = torch.Generator().manual_seed(seed)
    d.set_vocab(*build_vocab(torch.randint(0, 1000, (cfg_t.vocab_size,), generator=g), draft_vocab))
    return d.to(next(target.parameters()).dtype).eval()


# the tiny target and its verification probe (rows 4, 7, 12) are test_eval_specdec's fixtures


@pytest.fixture(scope="module")
def references(tiny):
    return [plain_greedy(tiny, p, N_NEW) for p in PROMPTS]


@pytest.mark.parametrize("block", BLOCKS)
def test_greedy_equals_plain_and_oracle_block_is_accepted_whole(exact_tiny, tiny, references, block):
    d = random_dflash(tiny, block)
    with DFlashDecoder(tiny, d, set()) as dec:
        assert dec.steps == block - 1 and dec.num_draft_tokens == block
        for p, ref in zip(PROMPTS, references):
            r = dec.generate(p, N_NEW)
            assert r.output_ids == ref and r.verify_steps >= 1 and r.draft_s > 0
            # a draft proposing the target's own continuation: every block accepted whole, + the bonus
            dec.propose = oracle_chain(p + ref, len(p), block - 1).__get__(dec)
            r = dec.generate(p, N_NEW)
            assert r.output_ids == ref
            full = (N_NEW - 1) // block
            assert r.verify_steps == full + (1 if (N_NEW - 1) % block else 0)
            rem = (N_NEW - 1) % block  # the last round's reference ends after `rem` drafted tokens
            assert r.accepted_per_position == [full + (1 if i < rem else 0) for i in range(block - 1)]
            del dec.propose


def test_context_cache_matches_full_recompute_and_tau_accounting(tiny):
    d = random_dflash(tiny, 4, layers=3)
    p = PROMPTS[1]
    with DFlashDecoder(tiny, d, set()) as dec:
        r = dec.generate(p, N_NEW)
        st = dec.last_round
        # built from the prefill and each round's accepted states (the last round's are not added:
        # generation ended), it equals the context of the committed positions computed in one pass
        n = st.ctx[0][0].shape[2]
        assert len(p) < n < len(st.tokens)
        with torch.inference_mode():
            out = tiny(input_ids=torch.tensor([st.tokens[:n]]), output_hidden_states=True)
            aux = torch.cat([out.hidden_states[k] for k in d.cfg.aux_layer_ids], -1)
            kv = d.context_kv(d.fuse(aux), torch.arange(n)[None])
        for (k, v), (k2, v2) in zip(st.ctx, kv):
            assert torch.allclose(k, k2, atol=1e-4) and torch.allclose(v, v2, atol=1e-4)
        assert r.verified_tokens == len(r.output_ids) - 1  # the prefill's token is not a verified one
        assert r.tau == r.verified_tokens / r.verify_steps
        assert sum(r.accepted_per_position) <= r.verified_tokens - r.verify_steps


def test_sampled_generation_runs_and_is_seeded(tiny):
    d = random_dflash(tiny, 4)
    runs = []
    for _ in range(2):
        with DFlashDecoder(tiny, d, set(), temperature=0.8, seed=3) as dec:
            runs.append(dec.generate(PROMPTS[0], 16).output_ids)
    assert runs[0] == runs[1] and len(runs[0]) == 16
    assert PlainDecoder(tiny, set(), temperature=0.8, seed=3).generate(PROMPTS[0], 16).output_ids


def test_block_sampling_is_lossless():
    """Temperature 1: a block's slots are drawn from q_1, q_2 that do not depend on the tokens drafted
    before them (one forward drafts the block); the verification walk (SpecDecoder._accept, the
    standard min(1, p/q) rule with the residual) still emits x1, x2 distributed as p(x1) p(x2 | x1)."""
    from eaglenest.evaluate.specdec import Proposal

    g = torch.Generator().manual_seed(0)
    p1 = torch.tensor([0.1, 0.5, 0.3, 0.1])
    p2 = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.05, 0.05, 0.6, 0.3], [0.25, 0.25, 0.25, 0.25], [0.0, 0.2, 0.0, 0.8]])
    q = torch.tensor([[0.4, 0.2, 0.2, 0.2], [0.1, 0.1, 0.4, 0.4]])  # slot 2's q ignores what slot 1 drew
    dec = DFlashDecoder.__new__(DFlashDecoder)  # only the acceptance walk: no target, no draft
    dec.temperature, dec.generator = 1.0, g
    counts = torch.zeros(4, 4)
    n = 20_000
    for _ in range(n):
        d = [int(torch.multinomial(q[k], 1, generator=g)) for k in range(2)]
        logits = torch.stack([p1.log(), p2[d[0]].log(), torch.zeros(4)])  # rows: root, after d1, after d2
        _, new = dec._accept(Proposal(d, [-1, 0], [1, 2], q), logits)
        if len(new) < 2:  # rejected at slot 1: the next round samples x2 from the target itself
            new.append(int(torch.multinomial(p2[new[0]], 1, generator=g)))
        counts[new[0], new[1]] += 1
    joint = p1[:, None] * p2
    assert 0.5 * float((counts / n - joint).abs().sum()) < 0.02
    assert counts[3, 0] == 0 and counts[3, 2] == 0  # never a pair the target rules out


def test_eval_runs_a_dflash_draft_with_its_block_and_refuses_other_steps(tiny_llama_dir, tiny, tmp_path, capsys):
    """A DFlash draft drafts block_size - 1 tokens per round: eval takes that when --steps is left
    out, and refuses an explicit --steps it cannot run with -- the EAGLE default 3 included -- rather
    than overriding it."""
    import argparse
    import json

    from eaglenest.cli import main
    from eaglenest.evaluate.run import resolve_draft_steps
    from eaglenest.export.format import save_draft

    draft = save_draft(random_dflash(tiny, 8), tmp_path / "draft")
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"question_id": 1, "prompt": "Name a colour."}) + "\n")
    argv = ["eval", "--model", str(tiny_llama_dir), "--draft", str(draft), "--bench", str(bench), "--limit", "1",
            "--max-new-tokens", "4", "--no-baseline", "--device", "cpu", "--dtype", "fp32"]
    assert main([*argv, "--out", str(tmp_path / "three.json"), "--steps", "3"]) == 2
    err = capsys.readouterr().err
    assert "--steps 3 cannot be run" in err and str(draft) in err and not (tmp_path / "three.json").exists()
    assert main([*argv, "--out", str(tmp_path / "default.json")]) == 0
    r = json.loads((tmp_path / "default.json").read_text())
    assert r["steps"] == 7 and r["num_draft_tokens"] == 8 and len(r["accept_per_position"]) == 7
    a = argparse.Namespace(draft=str(draft), steps=7, topk=1, num_draft_tokens=None)
    resolve_draft_steps(a)  # the block's own number, given explicitly
    assert a.steps == 7
