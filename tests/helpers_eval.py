"""Builders shared by the evaluation tests: a tiny target, a random draft for it, rigged proposals, a
batch-dependent F.linear, and the checks of exact verification (chunk vs one by one, spec == plain)."""

from __future__ import annotations

import torch

from eaglenest.capture.layers import default_layer_ids
from eaglenest.draft.model import Eagle3Config, Eagle3Draft
from eaglenest.draft.vocab import build_vocab
from eaglenest.evaluate.specdec import Proposal


def load_tiny(path, dtype=torch.float32, std: float | None = 0.3):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if std:
        diversify(m, std)
    return m.eval().requires_grad_(False)


def diversify(model, std: float = 0.3, seed: int = 1):
    """Re-draw a random target's matrices (not the tied embeddings; an MoE's stacked 3-D expert
    weights too) with a larger std: the default init makes a tiny random Llama (or Qwen3-MoE)
    repeat one token forever, which would hide cache bugs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() >= 2 and "embed" not in n:
                p.copy_(torch.randn(p.shape, generator=g).to(p.dtype) * std)
    return model


def eval_args(model, draft, bench, out, engine: str, **kw):
    """What `eaglenest eval` hands the evaluator, resolved by the CLI itself (evaluate.cli.eval_args) from
    keyword options: one flag per keyword (max_new_tokens=32 -> --max-new-tokens 32, no_baseline=True ->
    --no-baseline, engine_args={k: v} -> --engine-arg k=v; None and a false no_* leave the default)."""
    from eaglenest.evaluate.cli import eval_args as cli_eval_args

    argv = ["--model", str(model), "--draft", str(draft), "--out", str(out), "--bench", str(bench), "--engine", engine]
    for k, v in kw.items():
        flag = "--" + k.replace("_", "-")
        if k == "engine_args":
            argv += [x for kv in v.items() for x in ("--engine-arg", "=".join(map(str, kv)))]
        elif v is None or (v is False and k.startswith("no_")):
            continue
        elif isinstance(v, bool):
            argv.append(flag if v else "--no-" + k.replace("_", "-"))
        else:
            argv += [flag, str(v)]
    return cli_eval_args(argv)


# draft kinds the decoder tests run with: EAGLE-3, and EAGLE 3.1's flags on the MLA draft
KINDS = {"eagle3": {}, "eagle31-mla": {"attention": "mla", "fc_norm": True, "norm_output": True}}


def random_draft(target, draft_vocab: int = 4096, seed: int = 0, always: list[int] | None = None, **kind) -> Eagle3Draft:
    """A random-init draft that fits `target`: arbitrary token counts for the vocabulary, the
    target's embeddings, canonical aux ids; `kind`: Eagle3Config.from_target's attention / fc_norm / norm_output."""
    cfg_t = target.config
    g = torch.Generator().manual_seed(seed)
    cfg = Eagle3Config.from_target(cfg_t, draft_vocab, default_layer_ids(cfg_t.num_hidden_layers), **kind)
    torch.manual_seed(seed)
    d = Eagle3Draft(cfg, embed_weight=target.get_input_embeddings().weight)
    counts = torch.randint(0, 1000, (cfg_t.vocab_size,), generator=g)
    d.set_vocab(*build_vocab(counts, draft_vocab, always=always))
    dt = next(target.parameters()).dtype
    return d.to(dt).eval()


def plain_greedy(target, prompt, n, eos=()):
    from eaglenest.evaluate.specdec import PlainDecoder

    return PlainDecoder(target, set(eos)).generate(prompt, n).output_ids


def oracle_chain(reference: list[int], n_prompt: int, steps: int, wrong: bool = False, vocab: int = 49152):
    """A `propose` replacement that drafts the target's own greedy continuation (`reference`
    = prompt + plain greedy output), or always a wrong token when `wrong`."""

    def propose(self, st):
        done = len(st.tokens) - n_prompt  # tokens already committed after the prompt
        nxt = reference[n_prompt + done : n_prompt + done + steps]
        nxt = nxt + [0] * (steps - len(nxt))  # past the end of the reference: anything
        if wrong:
            nxt = [(t + 1) % vocab for t in nxt]
        return Proposal(nxt, list(range(-1, steps - 1)), list(range(1, steps + 1)))

    return propose


def oracle_tree(reference: list[int], n_prompt: int, steps: int, vocab: int = 49152):
    """A tree whose right path sits behind a wrong sibling at every depth (so the accepted path is
    never a prefix of the verify input: exercises the KV-cache gather)."""

    def propose(self, st):
        done = len(st.tokens) - n_prompt
        nxt = reference[n_prompt + done : n_prompt + done + steps]
        nxt = nxt + [0] * (steps - len(nxt))
        tokens, parents, depths = [], [], []
        parent = -1
        for j, t in enumerate(nxt):
            tokens += [(t + 7) % vocab, t]  # wrong sibling first, then the right one
            parents += [parent, parent]
            depths += [j + 1, j + 1]
            parent = len(tokens) - 1
        return Proposal(tokens, parents, depths)

    return propose


def batch_dependent_linear(shape: tuple[int, int]):
    """F.linear as a CPU whose batched kernel for `shape` splits K in two and adds the halves in the
    output dtype (what some blocked GEMMs do), while one-row calls go straight through."""
    native = torch.nn.functional.linear

    def linear(x, w, b=None):
        if x.numel() // x.shape[-1] > 1 and tuple(w.shape) == shape:
            h = x.shape[-1] // 2
            return native(x[..., :h], w[:, :h], b) + native(x[..., h:], w[:, h:])
        return native(x, w, b)

    return linear


def chunk_and_one_by_one(m, prompt: list[int], more: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of `more` fed after `prompt` one token at a time, and in one forward."""
    from eaglenest.evaluate.specdec import _new_cache

    prompt_t, more_t = torch.tensor([prompt]), torch.tensor([more])
    with torch.inference_mode():
        c1, ck = _new_cache(m), _new_cache(m)
        m(input_ids=prompt_t, past_key_values=c1, use_cache=True)
        m(input_ids=prompt_t, past_key_values=ck, use_cache=True)
        one = torch.cat([m(input_ids=more_t[:, i : i + 1], past_key_values=c1, use_cache=True).logits for i in range(len(more))], 1)
        chunk = m(input_ids=more_t, past_key_values=ck, use_cache=True).logits
    return one, chunk


def spec_equals_plain(m, prompts: list[list[int]], n_new: int, chain_only: bool = False) -> None:
    """Greedy speculative decoding (a random draft, then an oracle one; chain, and tree unless
    `chain_only`) gives plain greedy decoding's tokens on every prompt."""
    from eaglenest.evaluate.specdec import SpecDecoder

    d = random_draft(m, draft_vocab=4096)
    for p in prompts:
        ref = plain_greedy(m, p, n_new)
        with SpecDecoder(m, d, set(), steps=3) as sd:
            assert sd.generate(p, n_new).output_ids == ref
            sd.propose = oracle_chain(p + ref, len(p), 3).__get__(sd)
            r = sd.generate(p, n_new)
            assert r.output_ids == ref and r.tau > 3
        if chain_only:
            continue
        with SpecDecoder(m, d, set(), steps=3, topk=2, num_draft_tokens=7) as sd:
            assert sd.generate(p, n_new).output_ids == ref
            sd.propose = oracle_tree(p + ref, len(p), 3).__get__(sd)
            r = sd.generate(p, n_new)
            assert r.output_ids == ref and r.tau > 3
