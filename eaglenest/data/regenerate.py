"""`regenerate`: replace the assistant turns of a prepared DATA_DIR with the target's own answers.

The EAGLE-3 recipe trains the draft on what the *target* says, not on what the data set's authors
(often a bigger model) said.  For each prepared sample:

  * assistant turns are the runs of the loss mask (a turn starts where the mask goes 0 -> 1; with
    `prepare` a run is the message's tokens plus its end-of-turn token);
  * turn 1: the prompt is the sample's ids up to the start of that run (system + user turns and the
    assistant header, exactly as prepared); the target continues it, and the new sample is
    prompt + generated ids, with the mask over the generated ids (which end with the end-of-turn
    token when the target stopped by itself);
  * later turns, one after the other: the original non-assistant tokens between the two runs (the
    template's newline, the next user turn, the next assistant header) are appended to what was
    generated so far and the target answers again -- so every turn is conditioned on the target's
    own earlier answers, never on the data set's.  `--max-turns N` keeps only the first N turns.
  * a turn that stopped on the length limit (`--max-new-tokens`, or the data's max_length) ends
    the sample there: its later turns are dropped and the sample is counted as `truncated`.

What it writes is judged before it teaches: an answer *loops* when at least `loop_share` of its
`loop_ngram`-token n-grams repeat an earlier n-gram of the same answer (a greedy repetition loop:
a small target's answers often end in one, and a draft learns them easily, so the held-out
accuracy of looping data predicts a tau decoding never sees); an answer *hit the length cap* when a
turn stopped on the length limit (the `truncated` samples).  Both are counted in the output and in
the DATA_DIR's meta, and `--drop-loops` / `--drop-capped` leave them out of the DATA_DIR (the log
keeps them: a re-run with other flags rewrites the DATA_DIR without generating again).  Samples
whose prompt (data/prompts.py: normalized) repeats an earlier sample's are counted too.

Token-exact: every generation is checked against the ids the engine echoes (check_echo); a
mismatch fails the sample (`token_mismatch`).  Resumable: finished samples are appended (and
fsynced) to OUT/regenerate.jsonl as they complete; a re-run with the same settings skips them and
then rewrites the DATA_DIR shards from that log.  Failed samples are counted by reason, written to
OUT/regenerate_failures.jsonl, and retried by the next run.
"""

from __future__ import annotations

import hashlib
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from eaglenest import EaglenestError
from eaglenest.engines.base import Engine, Failure, Generated, Request, check_echo
from eaglenest.utils import Failures, append_jsonl_durable, atomic_write_json, progress, read_json, read_jsonl_tolerant

LOG_FILE = "regenerate.jsonl"
FAILURES_FILE = "regenerate_failures.jsonl"
SETTINGS_FILE = "regenerate.json"
# settings that must agree between runs appending to the same OUT
IDENTITY_KEYS = ("source_data", "source_n_samples", "target_fingerprint", "temperature", "max_new_tokens", "max_turns", "seed", "max_length")


def turn_spans(mask: list[int]) -> list[tuple[int, int]]:
    """Maximal runs of 1 in the loss mask, as [start, end)."""
    spans, start = [], None
    for i, m in enumerate(mask):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    if start is not None:
        spans.append((start, len(mask)))
    return spans


def repeated_share(tokens: list[int], n: int) -> float:
    """The share of `tokens`' n-grams that repeat an earlier n-gram of the same sequence (0 when it
    has fewer than n tokens)."""
    seen, repeats, total = set(), 0, 0
    for i in range(len(tokens) - n + 1):
        g = tuple(tokens[i : i + n])
        repeats += g in seen
        total += 1
        seen.add(g)
    return repeats / total if total else 0.0


def loops(row: dict, n: int, share: float) -> bool:
    """Whether a regenerated sample (a log row) has a generated turn that loops (module docstring)."""
    ids = row["input_ids"]
    return any(repeated_share(ids[a:b], n) >= share for a, b in turn_spans(row["loss_mask"]))


def sample_seed(base: int, sid: str, turn: int) -> int:
    """A per-sample, per-turn seed: the same sample gets the same sampling stream on a re-run."""
    h = hashlib.sha256(f"{base}:{sid}:{turn}".encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFFFFFF


@dataclass
class _State:
    id: str
    ids: list[int]  # original
    spans: list[tuple[int, int]]
    new_ids: list[int]
    new_mask: list[int]
    turn: int = 0
    truncated: bool = False
    generated: int = 0
    done: bool = False
    failure: Failure | None = None
    turns_done: int = 0
    n_source_turns: int = 0
    committed: int = 0  # length of new_ids up to the end of the last generated turn
    finish: list[str] = field(default_factory=list)


def _join_gap(out: list[int], gap: list[int], eot_ids: set[int]) -> list[int]:
    """Non-assistant tokens that follow a regenerated turn.  When the data's mask ended *before*
    the end-of-turn token, the gap starts with it and the generated turn already ends with it."""
    if gap and out and out[-1] in eot_ids and gap[0] == out[-1]:
        return gap[1:]
    return gap


def regenerate_samples(
    engine: Engine,
    samples,
    *,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    max_length: int | None,
    eot_ids: set[int],
    max_turns: int | None = None,
    vocab_size: int | None = None,
) -> list[dict | Failure]:
    """Regenerate a group of samples (all their turns); returns a log row or a Failure per sample."""
    states: list[_State] = []
    results: dict[str, dict | Failure] = {}
    for s in samples:
        spans = turn_spans(list(s.loss_mask))
        if not spans:
            results[s.id] = Failure(s.id, "no_assistant_turn", "the loss mask marks no assistant tokens")
            continue
        if spans[0][0] == 0:
            results[s.id] = Failure(s.id, "no_prompt", "the first assistant turn starts at token 0: nothing to prompt with")
            continue
        n_source = len(spans)
        if max_turns is not None:
            spans = spans[:max_turns]
        s0 = spans[0][0]
        states.append(_State(s.id, list(s.input_ids), spans, list(s.input_ids[:s0]), [0] * s0, n_source_turns=n_source))

    while True:
        active = [st for st in states if not st.done]
        if not active:
            break
        # one engine call per distinct token budget (they only differ near max_length)
        by_budget: dict[int, list[_State]] = {}
        for st in active:
            budget = max_new_tokens if max_length is None else min(max_new_tokens, max_length - len(st.new_ids))
            if budget < 1:
                if st.turn == 0:
                    st.failure = Failure(st.id, "too_long", f"prompt of {len(st.new_ids)} tokens leaves no room under max_length {max_length}")
                else:  # no room for this turn: drop its prompt (the user turn just appended) and stop
                    del st.new_ids[st.committed:], st.new_mask[st.committed:]
                    st.truncated = True
                st.done = True
                continue
            by_budget.setdefault(budget, []).append(st)
        for budget, group in by_budget.items():
            # seeds differ per (sample, turn): one engine call per seed would serialize everything, so
            # the batch gets the seed of its first member when sampling; greedy ignores it
            reqs = [Request(st.id, list(st.new_ids)) for st in group]
            seed_b = sample_seed(seed, group[0].id, group[0].turn) if temperature > 0 else seed
            try:
                outs = engine.generate(reqs, budget, temperature=temperature, seed=seed_b)
            except NotImplementedError as e:
                raise EaglenestError(f"engine {engine.name} cannot generate ({e}); use --engine vllm or hf") from None
            for st, req, res in zip(group, reqs, outs):
                _advance(st, req, res, eot_ids, vocab_size)

    for st in states:
        if st.failure is not None:
            results[st.id] = st.failure
        else:
            results[st.id] = {
                "id": st.id,
                "input_ids": st.new_ids,
                "loss_mask": st.new_mask,
                "turns": st.turns_done,
                "turns_in_source": st.n_source_turns,
                "generated_tokens": st.generated,
                "truncated": st.truncated,
                "finish": st.finish,
            }
    return [results[s.id] for s in samples]


def _advance(st: _State, req: Request, res, eot_ids: set[int], vocab_size: int | None) -> None:
    if isinstance(res, Failure):
        st.failure, st.done = res, True
        return
    assert isinstance(res, Generated)
    if (bad := check_echo(req.input_ids, res.prompt_ids, st.id)) is not None:
        st.failure, st.done = bad, True
        return
    out = list(res.output_ids)
    if vocab_size is not None and any(t < 0 or t >= vocab_size for t in out):
        st.failure, st.done = Failure(st.id, "token_out_of_vocab", f"engine generated an id outside [0, {vocab_size})"), True
        return
    if not out:
        st.failure, st.done = Failure(st.id, "empty_generation", f"turn {st.turn + 1}: the engine generated no token"), True
        return
    st.new_ids += out
    st.new_mask += [1] * len(out)
    st.generated += len(out)
    st.turns_done += 1
    st.committed = len(st.new_ids)
    st.finish.append(res.finish_reason)
    if res.finish_reason != "stop":
        st.truncated = True  # stopped by length: append nothing, drop the later turns
        st.done = True
        return
    end = st.spans[st.turn][1]
    if st.turn + 1 < len(st.spans):
        gap = st.ids[end : st.spans[st.turn + 1][0]]
        gap = _join_gap(out, gap, eot_ids)
        st.new_ids += gap
        st.new_mask += [0] * len(gap)
        st.turn += 1
        return
    # last kept turn: keep the template's trailing tokens (e.g. the newline after the end-of-turn
    # token) only when it was also the source's last turn; otherwise the later turns are dropped
    if st.turns_done == st.n_source_turns:
        tail = _join_gap(out, st.ids[end:], eot_ids)
        st.new_ids += tail
        st.new_mask += [0] * len(tail)
    st.done = True


@dataclass
class RegenerateSummary:
    done: int
    skipped_done: int
    failed: int
    generated_tokens: int
    truncated: int  # samples whose answer hit the length cap (written or dropped)
    seconds: float
    failures: dict
    meta: dict | None
    looping: int = 0  # samples with a looping answer (written or dropped)
    dropped: int = 0  # regenerated samples left out of the DATA_DIR (--drop-loops, --drop-capped)
    duplicate_prompts: int = 0  # samples whose normalized prompt repeats an earlier sample's


@dataclass
class Quality:
    """What regenerate judges its answers by (module docstring), and what it leaves out."""

    loop_ngram: int = 8
    loop_share: float = 0.2
    drop_loops: bool = False
    drop_capped: bool = False

    def verdicts(self, rows: list[dict]) -> tuple[list[bool], list[bool]]:
        """(looping, capped) per row."""
        return [loops(r, self.loop_ngram, self.loop_share) for r in rows], [bool(r["truncated"]) for r in rows]

    def keep(self, looping: bool, capped: bool) -> bool:
        return not (self.drop_loops and looping) and not (self.drop_capped and capped)


def duplicate_prompts(rows: list[dict], model_path) -> int:
    """How many samples' normalized prompts (data/prompts.py) repeat an earlier sample's."""
    from transformers import AutoTokenizer

    from eaglenest.data.prompts import prompt_ids, prompt_key

    path = Path(model_path)
    tok = AutoTokenizer.from_pretrained(path) if (path / "tokenizer_config.json").exists() else None
    keys = [prompt_key(prompt_ids(r["input_ids"], r["loss_mask"]), tok) for r in rows]
    return len(keys) - len(set(keys))


def run_regenerate(
    engine: Engine,
    data,
    out: Path | str,
    *,
    model_path: Path | str,
    max_new_tokens: int = 512,
    temperature: float = 0.7,
    seed: int = 0,
    max_turns: int | None = None,
    batch_size: int = 32,
    limit: int | None = None,
    max_failures: int | None = None,
    quality: Quality = Quality(),
) -> RegenerateSummary:
    """Regenerate `data` (a PreparedData) into the DATA_DIR `out` through `engine`; `quality` counts
    looping and length-capped answers and says which to leave out."""
    from eaglenest.data.store import Sample, write_prepared
    from eaglenest.models.target import eos_token_ids, target_fingerprint

    out = Path(out)
    if getattr(data, "path", None) is not None and out.resolve() == Path(data.path).resolve():
        raise EaglenestError(f"--out {out} is the input DATA_DIR: regenerate writes a new one")
    out.mkdir(parents=True, exist_ok=True)
    src_meta = dict(getattr(data, "meta", {}) or {})
    vocab_size = int(src_meta.get("vocab_size") or 0) or None
    max_length = src_meta.get("max_length")
    settings = {
        "source_data": str(Path(getattr(data, "path", "?")).resolve()),
        "source_n_samples": len(data),
        "target": str(model_path),
        "target_fingerprint": target_fingerprint(model_path),
        "engine": engine.name,
        "temperature": float(temperature),
        "max_new_tokens": int(max_new_tokens),
        "max_turns": max_turns,
        "seed": int(seed),
        "max_length": max_length,
    }
    sp = out / SETTINGS_FILE
    if sp.exists():
        old = read_json(sp, "regenerate settings")
        diff = [k for k in IDENTITY_KEYS if old.get(k) != settings.get(k)]
        if diff:
            details = ", ".join(f"{k}: {old.get(k)!r} there, {settings.get(k)!r} now" for k in diff)
            raise EaglenestError(f"{out} holds a regeneration with other settings ({details}); use another --out")
    else:
        atomic_write_json(sp, settings)

    log_path = out / LOG_FILE
    _truncate_torn(log_path)
    done_rows = {r["id"]: r for r in read_jsonl_tolerant(log_path)}
    n = len(data) if limit is None else min(limit, len(data))
    samples = [data[i] for i in range(n)]
    todo = [s for s in samples if s.id not in done_rows]
    eot_ids = set(eos_token_ids(Path(model_path)))
    print(f"regenerate: {len(todo)} samples to do ({n - len(todo)} already done) with engine {engine.name}, "
          f"temperature {temperature}, max {max_new_tokens} new tokens per turn", file=sys.stderr)

    if todo and hasattr(engine, "start"):
        engine.start("generate")  # a server engine starts here, so tok/s below is generation only
    failures = Failures()
    t0 = time.time()
    gen_tokens = 0
    bar = progress(total=len(todo), desc="regenerate", unit="sample")
    try:
        for i in range(0, len(todo), batch_size):
            group = todo[i : i + batch_size]
            rows = regenerate_samples(engine, group, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                                      max_length=max_length, eot_ids=eot_ids, max_turns=max_turns, vocab_size=vocab_size)
            good = [r for r in rows if isinstance(r, dict)]
            bad = [r for r in rows if isinstance(r, Failure)]
            if good:
                append_jsonl_durable(log_path, good)
                for r in good:
                    done_rows[r["id"]] = r
                gen_tokens += sum(r["generated_tokens"] for r in good)
            for f in bad:
                failures.record(f.reason, f.message, where=f"sample {f.id}", sample_id=f.id)
            if bad:
                append_jsonl_durable(out / FAILURES_FILE, [{"id": f.id, "reason": f.reason, "message": f.message, "time": time.time()} for f in bad])
            bar.update(len(group))
            bar.set_postfix(done=len(done_rows), failed=failures.total, tok_s=f"{gen_tokens / max(time.time() - t0, 1e-9):.1f}")
            if max_failures is not None and failures.total > max_failures:
                raise EaglenestError(f"stopping: {failures.total} failures exceed --max-failures {max_failures} ({failures.format()}); "
                                     "re-run the same command to resume")
    finally:
        bar.close()
    dt = time.time() - t0

    meta = None
    done = [done_rows[s.id] for s in samples if s.id in done_rows]
    looping, capped = quality.verdicts(done)
    final = [r for r, lo, ca in zip(done, looping, capped) if quality.keep(lo, ca)]
    judged = {"loop_rule": {"ngram": quality.loop_ngram, "min_repeated_share": quality.loop_share},
              "looping": sum(looping), "length_capped": sum(capped), "drop_loops": quality.drop_loops,
              "drop_capped": quality.drop_capped, "dropped": len(done) - len(final),
              "dropped_looping": sum(lo and not quality.keep(lo, ca) for lo, ca in zip(looping, capped)),
              "dropped_length_capped": sum(ca and not quality.keep(lo, ca) for lo, ca in zip(looping, capped)),
              "duplicate_prompts": duplicate_prompts(done, model_path) if done else 0}
    if done and not final:
        raise EaglenestError(f"regenerate: every one of the {len(done)} answers was left out ({judged['looping']} loop, "
                             f"{judged['length_capped']} hit the length cap): nothing to write to {out} (re-run without "
                             "--drop-loops / --drop-capped, or with a larger --max-new-tokens)")
    if final:
        n_trunc = sum(1 for r in final if r["truncated"])
        meta = write_prepared(
            out,
            (Sample(r["id"], r["input_ids"], r["loss_mask"]) for r in final),
            {
                "target": src_meta.get("target", str(model_path)),
                "tokenizer_fingerprint": src_meta.get("tokenizer_fingerprint"),
                "template_fingerprint": src_meta.get("template_fingerprint"),
                "max_length": max_length,
                "sources": [{"regenerated_from": settings["source_data"], "source_sources": src_meta.get("sources")}],
                "failures": failures.summary(),
                "notes": {
                    "regenerated": {**settings, "samples": len(final), "missing": n - len(done),
                                    "truncated": n_trunc, "generated_tokens": sum(r["generated_tokens"] for r in final),
                                    "judged": judged,
                                    "turns": sum(r["turns"] for r in final),
                                    "turns_dropped": sum(max(0, r["turns_in_source"] - r["turns"]) for r in final)},
                },
            },
            vocab_size=vocab_size or max(max(r["input_ids"]) for r in final) + 1,
        )
    print(
        f"regenerate: {len(todo) - failures.total} samples done this run ({gen_tokens:,} tokens generated, "
        f"{gen_tokens / max(dt, 1e-9):,.1f} tok/s); {failures.format()}; "
        + (f"wrote {len(final)} samples to {out}" if final else "nothing written"),
        file=sys.stderr,
    )
    if done:
        print(f"regenerate: of {len(done)} answers, {judged['looping']} loop (a turn with >= {quality.loop_share:.0%} of its "
              f"{quality.loop_ngram}-grams repeated) and {judged['length_capped']} hit the length cap; "
              f"{judged['dropped']} left out (--drop-loops: {judged['dropped_looping']}, --drop-capped: "
              f"{judged['dropped_length_capped']}); {judged['duplicate_prompts']} samples repeat an earlier sample's "
              "prompt (normalized)", file=sys.stderr)
    if (requests := engine.request_stats()) is not None:
        from eaglenest.engines.http import describe

        print(f"regenerate: engine requests: {describe(requests)}", file=sys.stderr)
    return RegenerateSummary(len(todo) - failures.total, n - len(todo), failures.total, gen_tokens, sum(capped), dt,
                             failures.summary(), meta, looping=sum(looping), dropped=judged["dropped"],
                             duplicate_prompts=judged["duplicate_prompts"])


def _truncate_torn(path: Path) -> None:
    from eaglenest.utils import atomic_write_bytes

    if path.exists():
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            atomic_write_bytes(path, data[: data.rfind(b"\n") + 1])
