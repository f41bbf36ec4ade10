"""Shared by the tests that assert a draft learned (tests/test_draft_learning.py, and the vLLM live
tests that serve such drafts): a few prompts whose answers the target regenerates (greedy, hf
engine, fp32), a draft over-fitted on them, its training accuracy per position, and the acceptance
per slot that decoding those same prompts gives, set side by side.

Why the two are comparable: the decoded text is the regenerated text (greedy, fp32, the same
prompts, DECODE_NEW < REGEN_NEW so every drafted token has a trained answer token behind it), so
decoding visits the very tokens the draft was trained on.  Acceptance is counted alike by our
decoder and vLLM: per slot, the share of verification rounds whose draft was accepted up to that
slot (`accept_per_position`, unconditional); `conditional` turns it into the acceptance at slot k
given slots < k were accepted, which is what the training accuracy per position estimates (EAGLE-3:
step k fed the true earlier tokens, as an accepted chain is; DFlash: prefix counts, exactly this).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for writing clean Python code.",
    "Explain what a prime number is.",
    "Name three colors of the rainbow.",
    "How do I boil an egg?",
    "What is photosynthesis?",
    "Suggest a name for a pet cat.",
]
DECODE_NEW = 40  # tokens decoded per prompt
REGEN_NEW = DECODE_NEW + 8  # tokens regenerated per answer: a DFlash block (8) past what is decoded


@dataclass
class Recipe:
    """How a kind's draft is over-fitted on the regenerated answers."""

    layers: str  # the store's layers (capture --layers)
    steps: int
    lr: float
    floor: float  # the least training accuracy at any position that the trained draft must reach
    flags: dict = field(default_factory=dict)  # more `eaglenest train` flags


_EAGLE = dict(ttt_steps=3, draft_vocab=1024)  # 3 TTT positions = the 3 decoding steps `eval` runs by default
RECIPES = {
    # measured (a 2-core AVX512-BF16 machine): the last training accuracy per position 0.96 / 0.97 / 0.95
    # (EAGLE-3), 0.98 / 0.97 / 0.97 (3.1); the untrained draft's 0.004 / 0 / 0, and a 1-step EAGLE-3 draft
    # decodes with conditional acceptance 0.12 / 0.22 / 0: floor 0.8
    "eagle3": Recipe("auto", 60, 3e-3, 0.8, _EAGLE),
    "eagle31": Recipe("auto", 60, 3e-3, 0.8, {**_EAGLE, "fc_norm": True, "norm_output": True}),
    # the MLA draft learns more slowly: 0.88 / 0.72 / 0.57 after the same 60 steps (untrained: 0 / 0 / 0);
    # its floor sits under the last position's 0.57 (more steps would cost CI time)
    "mla": Recipe("auto", 60, 3e-3, 0.45, {**_EAGLE, "draft_attention": "mla"}),
    # 0.69 / 0.76 / 0.76 / 0.80 / 0.86 / 0.87 / 0.87 per block slot after 100 steps (60 at 3e-3 left
    # 0.43 at slot 7); the untrained draft's 0.016 / 0 ..., and a 1-step draft (one full-lr Adam step
    # already matches hidden states to labels) decodes with 0.57 / 0.36 / 0.54 / 0.38 / 0.40: floor 0.55
    "dflash": Recipe("dflash", 100, 6e-3, 0.55, dict(draft_kind="dflash", block_size=8, draft_layers=1, dflash_anchors=64,
                                                   draft_vocab=1024)),
}
# the bars (tests/test_draft_learning.py's docstring says where they come from):
WITHIN = 0.1  # |conditional acceptance - training accuracy| per slot, beyond its sampling error (assert_accepts_as_trained)


@dataclass
class Regenerated:
    """The QUESTIONS' prepared data with the target's own greedy answers, and the bench file that
    asks the same questions (`eaglenest eval --bench`)."""

    data: Path
    bench: Path
    answers: dict[str, list[int]]  # question_id -> the regenerated answer's ids


def run_cli(*argv) -> None:
    from eaglenest.cli import main

    assert main([str(a) for a in argv]) == 0, argv


def regenerate_questions(model, root: Path, questions=QUESTIONS, new: int = REGEN_NEW) -> Regenerated:
    """Prepare `questions` (a placeholder answer each) and regenerate their answers with `model`
    (greedy, hf engine, fp32: the text our decoder and vLLM then decode in fp32)."""
    from eaglenest.data import prepare
    from eaglenest.data.regenerate import turn_spans
    from eaglenest.data.store import PreparedData

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    src = root / "convs.jsonl"
    src.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": "."}]}) + "\n"
                           for q in questions))
    prepare(model=str(model), data=[str(src)], out=root / "data", max_length=256, verbose=False)
    run_cli("regenerate", "--model", model, "--data", root / "data", "--out", root / "regen", "--engine", "hf", "--temperature", "0",
            "--max-new-tokens", new, "--dtype", "fp32")
    bench = root / "bench.jsonl"
    bench.write_text("".join(json.dumps({"question_id": f"q{i}", "prompt": q}) + "\n" for i, q in enumerate(questions)))
    # `prepare` keeps the source order (question i is its i-th sample); regenerate keeps the ids
    order = PreparedData(root / "data").ids()
    regen = {s.id: s for s in PreparedData(root / "regen")}
    assert sorted(regen) == sorted(order), "every question regenerated (none failed or dropped)"
    answers = {f"q{i}": (s := regen[sid]).input_ids[turn_spans(s.loss_mask)[0][0]:] for i, sid in enumerate(order)}
    return Regenerated(root / "regen", bench, answers)


def capture(model, data: Path, out: Path, layers: str = "auto") -> Path:
    """fp32 features in an fp32 store: what the decoder feeds the draft in fp32, to the last bit."""
    if not (out / "meta.json").exists():
        run_cli("capture", "--model", model, "--data", data, "--out", out, "--layers", layers, "--dtype", "fp32",
                "--store-dtype", "fp32", "--device", "cpu")
    return out


def train(model, features: Path, run: Path, steps: int, lr: float, **flags) -> Path:
    """A short fp32 run on every sample (no held-out split); `flags` are `eaglenest train` flags."""
    argv = ["train", "--model", model, "--features", features, "--out", run, "--max-steps", steps, "--lr", lr,
            "--batch-tokens", 2048, "--eval-fraction", 0, "--device", "cpu", "--dtype", "fp32"]
    for k, v in flags.items():
        argv += [f"--{k.replace('_', '-')}"] + ([] if v is True else [v])
    run_cli(*argv)
    return run


def train_recipe(model, features: Path, run: Path, kind: str) -> Path:
    r = RECIPES[kind]
    return train(model, features, run, r.steps, r.lr, **r.flags)


def export(run: Path, out: Path, model=None) -> Path:
    run_cli("export", "--run", run, "--out", out, *(["--model", model] if model else []))
    return out


def train_acc(run: Path) -> tuple[list[float], list[float]]:
    """(first, last) training accuracy per position from RUN_DIR/metrics.jsonl.  A step's statistics
    come from its forward, before its update: the first row is the untrained draft's accuracy on the
    data, the last row the accuracy one update before the end."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return rows[0]["train_acc"], rows[-1]["train_acc"]


def conditional(accept_per_position: list[float]) -> list[float | None]:
    """Acceptance per slot given the earlier slots were accepted, from the per-slot shares of rounds
    (None where no round reached the slot)."""
    out, prev = [], 1.0
    for a in accept_per_position:
        out.append(a / prev if prev > 0 else None)
        prev = a
    return out


def eval_args(model, draft, bench, out, engine: str, **kw):
    """`eaglenest eval`'s arguments (helpers_eval.eval_args): greedy, fp32, DECODE_NEW tokens, the draft's
    default steps, unless `kw` says otherwise."""
    from helpers_eval import eval_args as cli_eval_args

    return cli_eval_args(model, draft, bench, out, engine, **{"max_new_tokens": DECODE_NEW, "dtype": "fp32", "device": "cpu",
                                                              "temperature": 0.0, **kw})


def decodes_the_answers(report: dict, answers: dict[str, list[int]]) -> int:
    """How many prompts the decoder answered with the regenerated answer's first tokens (its text is
    then the training text)."""
    return sum(r["output_ids"] == answers[r["id"]][: len(r["output_ids"])] for r in report["per_prompt"])


def assert_accepts_as_trained(report: dict, acc: list[float], within: float = WITHIN) -> list[float | None]:
    """Per slot k, the decoder's conditional acceptance c_k is within `within` + 2 sqrt(a_k (1 - a_k) / n_k)
    of the training accuracy a_k, n_k = the rounds that reached slot k: decoding samples slot k's
    acceptance n_k times (two standard errors of that share), and `within` covers what differs
    systematically (rounds start at some tokens only, the weights are exported in bf16, a step
    later).  Slots no round reached are not compared; returns the conditional acceptance."""
    cond = conditional(report["accept_per_position"])
    reached = [report["verify_steps"]] + [report["verify_steps"] * a for a in report["accept_per_position"][:-1]]
    bad = [(k + 1, round(c, 3), round(a, 3), round(n)) for k, (c, a, n) in enumerate(zip(cond, acc, reached))
           if n >= 1 and abs(c - a) > within + 2 * (a * (1 - a) / n) ** 0.5]
    assert not bad, (f"(slot, conditional acceptance, training accuracy, rounds) not within {within} + 2 standard errors: {bad}; "
                     f"all slots: {[None if c is None else round(c, 3) for c in cond]} vs {[round(a, 3) for a in acc]}")
    return cond


class OurDecoder:
    """Our decoder in this process, the target loaded once for several drafts: what `eaglenest eval
    --engine hf` runs per prompt (the same decoders, prompt ids and report totals), without its
    exact-verification set-up (a kernel probe and row-wise forwards that cost minutes on a 2-core
    machine; fp32 near-ties are rare, and `decodes_the_answers` says where one parted)."""

    def __init__(self, model):
        import torch

        from eaglenest.models.target import eos_token_ids, load_target, load_tokenizer, resolve_model_path

        self.tok = load_tokenizer(str(model))
        self.target = load_target(str(model), "fp32", "cpu")
        self.eos = set(eos_token_ids(resolve_model_path(str(model)), self.tok))
        self.dtype = torch.float32

    def __call__(self, draft_dir: Path, bench: Path, max_new_tokens: int = DECODE_NEW) -> dict:
        from eaglenest.evaluate.dflash import DFlashDecoder
        from eaglenest.evaluate.run import chat_prompt_ids, load_draft_for_target, summarize
        from eaglenest.evaluate.specdec import SpecDecoder

        draft = load_draft_for_target(draft_dir, self.target, "cpu", self.dtype)
        if draft.cfg.kind == "dflash":
            dec = DFlashDecoder(self.target, draft, self.eos)
        else:
            dec = SpecDecoder(self.target, draft, self.eos, steps=3)  # eval's default steps
        records = []
        with dec:
            for line in bench.read_text().splitlines():
                q = json.loads(line)
                r = dec.generate(chat_prompt_ids(self.tok, [{"role": "user", "content": q["prompt"]}]), max_new_tokens)
                records.append({"id": q["question_id"], "generated_tokens": len(r.output_ids), "verified_tokens": r.verified_tokens,
                                "verify_steps": r.verify_steps, "accepted_per_position": r.accepted_per_position, "wall_s": r.wall_s,
                                "output_ids": r.output_ids})
        return {"steps": dec.steps, **summarize(records, dec.steps), "per_prompt": records}


def counted_tau(report: dict) -> float:
    """1 + accepted drafts per round: tau as vLLM counts it, which also counts what a generation's
    last round accepted past max_tokens (our decoder's tau keeps only the tokens it emits; with a
    well-accepted draft that is 5 % of tau on these short answers), so the engines compare alike."""
    return 1 + sum(report["accept_per_position"])
