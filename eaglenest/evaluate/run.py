"""`eaglenest eval`: acceptance length (tau) and speedup of a draft on a benchmark.

The in-process transformers evaluator lives here (`run_eval_hf`); other engines plug in as
modules `eaglenest/evaluate/engine_<name>.py` exposing `run_eval(args) -> dict` (the report
without the common fields that `evaluate()` fills in).  They are found without importing them
and imported only when chosen, so a missing/heavy engine never slows the CLI down.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from eaglenest import EaglenestError
from eaglenest.kinds.registry import get as get_kind
from eaglenest.utils import keep_freed_heap

DTYPES = ("bf16", "fp32", "fp16")
# bf16 is the default: on this AVX-512-BF16 CPU a bf16 forward of 4 tokens costs ~1.1x one of 1
# token (fp32: ~1.7x), which is what verification needs, and it is the dtype engines serve in.
# Greedy equivalence is judged against a baseline in the same dtype; verification.py probes at set-up
# whether verification is bit-identical to plain decoding on this machine and makes it so where not.
DEFAULT_DTYPE = "bf16"


# ----------------------------------------------------------------------------------------------
# the engine registry


def run_eval_hf(args) -> dict:
    return HFEvaluator(args).run()


ENGINE_EVALUATORS: dict[str, Callable] = {"hf": run_eval_hf}


def engine_evaluators() -> dict[str, Callable]:
    """ENGINE_EVALUATORS plus every `eaglenest.evaluate.engine_<name>` module present (imported lazily)."""
    evs = dict(ENGINE_EVALUATORS)
    here = Path(__file__).parent
    for info in pkgutil.iter_modules([str(here)]):
        if info.name.startswith("engine_"):
            name = info.name[len("engine_"):]
            evs.setdefault(name, _lazy(f"{__package__}.{info.name}"))
    return evs


def _lazy(module: str) -> Callable:
    def run(args):
        return importlib.import_module(module).run_eval(args)

    run.__qualname__ = f"{module}.run_eval"
    return run


# ----------------------------------------------------------------------------------------------
# shared helpers (engine evaluators may use them too)


def chat_prompt_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The target's own chat template with the generation prompt, as token ids."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def check_draft_fits(cfg, target_config, where: str = "draft") -> None:
    """One-line EaglenestError when a draft (DraftConfig) cannot run on this target."""
    H, V, N = target_config.hidden_size, target_config.vocab_size, target_config.num_hidden_layers
    if cfg.target_hidden_size != H:
        raise EaglenestError(
            f"{where} was trained for a target with hidden size {cfg.target_hidden_size} "
            f"(fc takes {len(cfg.aux_layer_ids)}x{cfg.target_hidden_size}), but this target has hidden size {H}"
        )
    if cfg.hidden_size != H:
        raise EaglenestError(
            f"{where} hidden size {cfg.hidden_size} != target hidden size {H} (the draft runs on the target's embeddings)"
        )
    if cfg.vocab_size != V:
        raise EaglenestError(f"{where} vocabulary size {cfg.vocab_size} != target vocabulary size {V}")
    if cfg.draft_vocab_size > V:
        raise EaglenestError(f"{where} draft vocabulary ({cfg.draft_vocab_size}) is larger than the target's ({V})")
    if cfg.target_num_layers and cfg.target_num_layers != N:
        raise EaglenestError(f"{where} was trained for a {cfg.target_num_layers}-layer target, this target has {N} layers")
    get_kind(cfg.kind).check_fits(cfg, N, where)  # the kind's target layers (EAGLE-3: three; DFlash: any)


def read_draft_dir(draft, num_layers: int | None = None):
    """The draft directory read once (export/format.py DraftDir), refused without a config.json;
    `draft` may already be one.  With `num_layers`, its layer ids resolved for that target."""
    from eaglenest.export.format import DraftDir, read_draft

    if not isinstance(draft, DraftDir):
        draft = Path(draft)
        if not (draft / "config.json").exists():
            raise EaglenestError(f"--draft {draft}: no config.json (not an exported draft directory)")
        draft = read_draft(draft)
    return draft if num_layers is None else draft.resolve(num_layers)  # ids omitted or in another trainer's form


def check_draft_dir(draft_dir, target_config):
    """Check a draft directory's config against the target's config (before loading any weights);
    returns the DraftDir."""
    d = read_draft_dir(draft_dir, target_config.num_hidden_layers)
    check_draft_fits(d.cfg, target_config, where=f"draft {d.path}")
    return d


def load_draft_for_target(draft_dir, target, device: str, dtype) -> "object":
    """Validate the draft against the target, then load it on the target's embeddings."""
    from eaglenest.draft.vocab import check_vocab
    from eaglenest.export.format import load_draft

    d = check_draft_dir(draft_dir, target.config)
    draft_dir = d.path
    emb = target.get_input_embeddings().weight
    head = target.get_output_embeddings()
    draft = load_draft(d, embed_weight=emb, target_config=target.config, device=device, dtype=dtype,
                       lm_head_weight=None if head is None else head.weight)
    check_draft_fits(draft.cfg, target.config, where=f"draft {draft_dir}")
    why = check_vocab(draft.d2t.cpu(), draft.t2d.cpu())
    if why:
        raise EaglenestError(f"draft {draft_dir}: {why}")
    return draft


def summarize(records: list[dict], steps: int, totals: dict | None = None) -> dict:
    """Aggregate per-generation records into the report's totals.  `totals` (verify_steps,
    verified_tokens, accepted_per_position) replaces the per-record counts where a server decoded
    several generations at once and only counted them together."""
    gen = sum(r["generated_tokens"] for r in records)
    ver_tok = totals["verified_tokens"] if totals else sum(r["verified_tokens"] for r in records)
    vsteps = totals["verify_steps"] if totals else sum(r["verify_steps"] for r in records)
    acc = totals["accepted_per_position"] if totals else [sum(r["accepted_per_position"][i] for r in records) for i in range(steps)]
    wall = sum(r["wall_s"] for r in records)
    out = {
        "tau": ver_tok / vsteps if vsteps else None,
        "generated_tokens": gen,
        "verified_tokens": ver_tok,
        "verify_steps": vsteps,
        "accept_per_position": [a / vsteps if vsteps else None for a in acc],
        "spec_wall_s": wall,
        "spec_tokens_per_s": gen / wall if wall > 0 else None,
    }
    if vsteps and all("draft_s" in r for r in records):  # our decoder times its draft: the drafting cost per round
        ds = sum(r["draft_s"] for r in records)
        out.update(draft_s=ds, draft_ms_per_round=1000 * ds / vsteps, draft_share_of_wall=ds / wall if wall > 0 else None)
    base = [r for r in records if r.get("baseline_wall_s") is not None]
    if base:
        # the speedup compares the two decoders on the same generations (--baseline-limit may
        # leave the plain decoder only the first prompts)
        bgen = sum(r["baseline_tokens"] for r in base)
        bwall = sum(r["baseline_wall_s"] for r in base)
        sgen = sum(r["generated_tokens"] for r in base)
        swall = sum(r["wall_s"] for r in base)
        out["baseline_tokens"] = bgen
        out["baseline_wall_s"] = bwall
        out["baseline_tokens_per_s"] = bgen / bwall if bwall > 0 else None
        if swall > 0 and out["baseline_tokens_per_s"]:
            out["speedup"] = (sgen / swall) / out["baseline_tokens_per_s"]
    return out


# ----------------------------------------------------------------------------------------------
# the transformers evaluator


class HFEvaluator:
    """Our own speculative decoding over the transformers target.  With --workers N the
    conversations are spread over N processes (each with its own copy of the target and draft,
    and cores / N threads): batch-1 decoding of a small target on a CPU is bound by per-op latency,
    not by the cores, so two 1-thread processes decode more tokens/s than one 2-thread process
    (git show 0c8d13e:bench/results/eval_workers_cpu.json).
    Each conversation is decoded exactly as with one process; only the thread count differs."""

    def __init__(self, args):
        self.args = args

    def setup(self, threads: int | None = None) -> dict:
        """Load the target and the draft, build the decoders, warm up.  Returns the report fields
        that depend on what was loaded."""
        import torch

        from eaglenest.evaluate.specdec import PlainDecoder, resolve_num_draft_tokens
        from eaglenest.evaluate.verification import prepare, resolve_attention
        from eaglenest.models.target import eos_token_ids, load_target, load_tokenizer, resolve_model_path
        from eaglenest.utils import resolve_device

        a = self.args
        if threads:
            torch.set_num_threads(threads)
        torch.manual_seed(a.seed)
        ndt = resolve_num_draft_tokens(a.steps, a.topk, a.num_draft_tokens)
        device = resolve_device(a.device)
        tdtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[a.dtype]
        self.tok = tok = load_tokenizer(a.model, a.trust_remote_code)
        target = load_target(a.model, a.dtype, device, a.trust_remote_code)
        # verification forwards bit-identical to plain decoding where this machine allows (verification.py)
        attention = resolve_attention(getattr(a, "attention", "auto"), device)
        verification = prepare(target, rows=ndt, topk=a.topk, attention=attention, linears=getattr(a, "linears", "auto"))
        if not verification["exact"]:
            print(f"eval: verification is not bit-identical to plain decoding on this machine "
                  f"({verification['probe_result']['end_to_end'][-1]['first_difference']}): greedy outputs may "
                  f"differ from plain greedy at near-ties", file=sys.stderr)
        draft = load_draft_for_target(getattr(a, "draft_dir", None) or a.draft, target, device, tdtype)
        self.eos = eos = set(eos_token_ids(resolve_model_path(a.model), tok))
        temp = float(a.temperature)
        # the kind's decoder (DFlash: a block per round, steps = block_size - 1: resolve_draft_steps)
        self.spec = get_kind(draft.cfg.kind).decoder(target, draft, eos, a, num_draft_tokens=ndt, temperature=temp,
                                                     draft_sampling=draft_sampling(a))
        self.plain = None if a.no_baseline else PlainDecoder(target, eos, temperature=temp, seed=a.seed)
        # warm-up (first calls of the CPU kernels pay one-time setup): not timed, not reported
        warm = chat_prompt_ids(tok, [{"role": "user", "content": "Hello!"}])
        self.spec.generate(warm, 8)
        if self.plain:
            self.plain.generate(warm, 8)
        return {"aux_ids": draft.cfg.aux_layer_ids, "draft_vocab": draft.cfg.draft_vocab_size, "device": device,
                "attention": target.config._attn_implementation, "verification": verification}

    def conversation(self, n_done: int, p) -> tuple[list[dict], list[dict]]:
        """All turns of one benchmark conversation: (records, greedy mismatches)."""
        a, tok, eos = self.args, self.tok, self.eos
        base_limit = getattr(a, "baseline_limit", None)  # plain decoding on the first N prompts only
        with_base = self.plain is not None and (base_limit is None or n_done < base_limit)
        records, mismatches = [], []
        hist_s: list[dict] = []  # each decoder answers the next turn after its own answer
        hist_b: list[dict] = []
        for turn, question in enumerate(p.turns[: a.turns], start=1):
            hist_s.append({"role": "user", "content": question})
            ids = chat_prompt_ids(tok, hist_s)
            r = self.spec.generate(ids, a.max_new_tokens)
            hist_s.append({"role": "assistant", "content": _answer_text(tok, r.output_ids, eos)})
            rec = {
                "id": p.id,
                "turn": turn,
                "prompt_tokens": len(ids),
                "tau": r.tau,
                "generated_tokens": len(r.output_ids),
                "verified_tokens": r.verified_tokens,
                "verify_steps": r.verify_steps,
                "accepted_per_position": r.accepted_per_position,
                "finish_reason": r.finish_reason,
                "wall_s": r.wall_s,
                "draft_s": r.draft_s,
                "output_ids": r.output_ids,
            }
            if with_base:
                hist_b.append({"role": "user", "content": question})
                bids = chat_prompt_ids(tok, hist_b)
                b = self.plain.generate(bids, a.max_new_tokens)
                hist_b.append({"role": "assistant", "content": _answer_text(tok, b.output_ids, eos)})
                rec["baseline_tokens"] = len(b.output_ids)
                rec["baseline_wall_s"] = b.wall_s
                if float(a.temperature) <= 0:
                    same = bids == ids and b.output_ids == r.output_ids
                    rec["matches_baseline"] = same
                    if not same:
                        mismatches.append(_first_difference(p.id, turn, ids, bids, r.output_ids, b.output_ids))
            records.append(rec)
        return records, mismatches

    def run(self) -> dict:
        from eaglenest.evaluate.specdec import resolve_num_draft_tokens
        from eaglenest.models.target import load_config, resolve_model_path
        from eaglenest.utils import progress, resolve_device, usable_cpus

        a = self.args
        ndt = resolve_num_draft_tokens(a.steps, a.topk, a.num_draft_tokens)  # fail before loading anything
        dataset, prompts = load_prompts(a)
        path = resolve_model_path(a.model)
        check_draft_dir(getattr(a, "draft_dir", None) or a.draft, load_config(a.model, a.trust_remote_code))  # fail before loading weights
        resolve_device(a.device)  # a device that is not there: one error here, not one per worker
        workers = max(1, min(int(getattr(a, "workers", 1) or 1), len(prompts)))
        pool = None
        if workers == 1:
            meta = self.setup()
            results = (self.conversation(i, p) for i, p in enumerate(prompts))
        else:
            import multiprocessing as mp

            threads = max(1, usable_cpus() // workers)
            pool = mp.get_context("spawn").Pool(workers, initializer=_worker_init, initargs=(a, threads))
            meta = pool.apply(_worker_meta)
            results = pool.imap(_worker_conversation, list(enumerate(prompts)))  # in prompt order

        records: list[dict] = []
        mismatches: list[dict] = []
        bar = progress(total=len(prompts), desc="eval", unit="prompt")
        ok = False
        try:
            for recs, mm in results:
                records += recs
                mismatches += mm
                bar.update(1)
                post = {"spec": _rate(records, "generated_tokens", "wall_s")}
                if not a.no_baseline:
                    post["base"] = _rate(records, "baseline_tokens", "baseline_wall_s")
                vs = sum(x["verify_steps"] for x in records)
                if vs:
                    post["tau"] = f"{sum(x['verified_tokens'] for x in records) / vs:.2f}"
                bar.set_postfix(post)
            ok = True
        finally:
            bar.close()
            if pool is not None:
                if ok:  # let the workers exit on their own (terminate leaks their semaphores)
                    pool.close()
                    pool.join()
                else:
                    pool.terminate()
            elif hasattr(self, "spec"):
                self.spec.close()

        report = report_header("hf", a, dataset, len(prompts), records, steps=a.steps, topk=a.topk, ndt=ndt, path=path,
                               aux_ids=meta["aux_ids"], draft_vocab=meta["draft_vocab"], device=meta["device"],
                               attention=meta["attention"], workers=workers, verification=meta["verification"])
        return finish_report(report, records, a.steps, mismatches if not a.no_baseline and float(a.temperature) <= 0 else None)


def _rate(records: list[dict], tokens: str, wall: str) -> str:
    w = sum(r.get(wall) or 0.0 for r in records)
    return f"{sum(r.get(tokens) or 0 for r in records) / w:.1f}tok/s" if w else "-"


# one HFEvaluator per worker process (--workers N)
_WORKER: dict = {}


def _worker_init(args, threads: int) -> None:
    # an exception escaping a Pool initializer makes the pool respawn workers forever: keep it
    # and raise it from the first task instead
    try:
        keep_freed_heap()  # a spawned worker does not pass through cli.run, the process entry
        ev = HFEvaluator(args)
        _WORKER["meta"] = ev.setup(threads)
        _WORKER["ev"] = ev
    except Exception as e:  # noqa: BLE001 -- re-raised (picklable) in the parent by _worker_meta
        _WORKER["error"] = EaglenestError(f"eval worker failed to start: {type(e).__name__}: {e}")


def _worker_meta() -> dict:
    if "error" in _WORKER:
        raise _WORKER["error"]
    return _WORKER["meta"]


def _worker_conversation(item):
    return _WORKER["ev"].conversation(*item)


def load_prompts(a) -> tuple[str, list]:
    """The benchmark's prompts after --limit, with the checks every evaluator needs."""
    from eaglenest.evaluate.mtbench import load_bench

    if a.max_new_tokens < 1:
        raise EaglenestError("--max-new-tokens must be >= 1")
    dataset, prompts = load_bench(a.bench)
    if a.limit is not None:
        prompts = prompts[: a.limit]
    if not prompts:
        raise EaglenestError("no prompts to evaluate (check --limit)")
    return dataset, prompts


def run_conversations(prompts, turns: int, tok, eos: set[int], desc: str, answer, concurrency: int = 1) -> list[dict]:
    """Every benchmark conversation turn by turn, with a progress bar: `answer(prompt, turn, ids)`
    returns the turn's record (with "output_ids"), and that answer joins the next turn's history.
    `concurrency` > 1: that many conversations at once (a server's batch); records in prompt order."""
    from concurrent.futures import ThreadPoolExecutor

    from eaglenest.utils import progress

    bar = progress(total=sum(min(turns, len(p.turns)) for p in prompts), desc=desc, unit="gen")

    def one(p) -> list[dict]:
        hist: list[dict] = []
        recs = []
        for turn, question in enumerate(p.turns[:turns], start=1):
            hist.append({"role": "user", "content": question})
            rec = answer(p, turn, chat_prompt_ids(tok, hist))
            hist.append({"role": "assistant", "content": _answer_text(tok, rec["output_ids"], eos)})
            recs.append(rec)
            bar.update(1)
        return recs

    try:
        if concurrency <= 1:
            return [r for p in prompts for r in one(p)]
        with ThreadPoolExecutor(max_workers=min(concurrency, len(prompts))) as ex:
            return [r for recs in ex.map(one, prompts) for r in recs]
    finally:
        bar.close()


def draft_sampling(a) -> str:
    """--draft-sampling (specdec.DRAFT_SAMPLING; argument namespaces built by hand default to sample)."""
    return getattr(a, "draft_sampling", None) or "sample"


def report_header(engine: str, a, dataset: str, n_prompts: int, records: list[dict], *, steps: int, topk: int, ndt: int,
                  path, aux_ids, draft_vocab: int, device: str, **extra) -> dict:
    """The settings part of every evaluator's report (finish_report adds the results)."""
    return {
        "engine": engine,
        "dataset": dataset,
        "n_prompts": n_prompts,
        "turns": a.turns,
        "n_generations": len(records),
        "steps": steps,
        "topk": topk,
        "num_draft_tokens": ndt,
        "temperature": float(a.temperature),
        "draft_sampling": draft_sampling(a) if float(a.temperature) > 0 and topk == 1 else None,
        "batch_size": 1,
        "max_new_tokens": a.max_new_tokens,
        "seed": a.seed,
        "target": str(a.model),
        "target_path": str(path),
        "draft": str(a.draft),
        "aux_layer_ids": None if aux_ids is None else list(aux_ids),
        "draft_vocab_size": draft_vocab,
        "device": device,
        "dtype": a.dtype,
        "workers": 1,  # decoding processes on our side (the hf evaluator's --workers)
        **extra,
    }


PER_PROMPT_KEYS = ("id", "turn", "tau", "generated_tokens", "verify_steps", "verified_tokens", "accepted_per_position",
                   "finish_reason", "wall_s", "baseline_wall_s", "baseline_tokens", "matches_baseline",
                   "output_ids")  # the generated ids: reports of two engines can be compared prompt by prompt


def finish_report(report: dict, records: list[dict], steps: int, mismatches: list[dict] | None,
                  totals: dict | None = None) -> dict:
    """The fields every engine's report shares, from its per-generation records (and `totals`, see
    summarize).  `mismatches` is None when no greedy baseline was compared."""
    report.update(summarize(records, steps, totals))
    report.setdefault("baseline_tokens_per_s", None)
    report.setdefault("speedup", None)
    for k in ("draft_s", "draft_ms_per_round", "draft_share_of_wall"):  # known where our decoder times its draft
        report.setdefault(k, None)
    # what the comparison covered: prompts decoded plainly too, and generations compared token by token
    report["baseline_prompts"] = len({r["id"] for r in records if "baseline_wall_s" in r})
    report["texts_compared"] = sum("matches_baseline" in r for r in records)
    report["greedy_matches_baseline"] = None if mismatches is None else not mismatches
    if mismatches is not None:
        report["greedy_mismatches"] = mismatches
    report["per_prompt"] = [{k: rec[k] for k in PER_PROMPT_KEYS if k in rec} for rec in records]
    return report


def merge_server_baseline(records: list[dict], base_records: list[dict] | None, greedy: bool) -> list[dict] | None:
    """Attach a server's non-speculative run to the speculative records; return the greedy
    mismatches (None when there is nothing to compare)."""
    if base_records is None:
        return None
    mismatches = []
    for r, b in zip(records, base_records):
        r["baseline_tokens"] = b["generated_tokens"]
        r["baseline_wall_s"] = b["wall_s"]
        if greedy:
            same = r["prompt_ids"] == b["prompt_ids"] and r["output_ids"] == b["output_ids"]
            r["matches_baseline"] = same
            if not same:
                mismatches.append(_first_difference(r["id"], r["turn"], r["prompt_ids"], b["prompt_ids"], r["output_ids"],
                                                    b["output_ids"], b.get("top_logprobs")))
    return mismatches if greedy else None


def _answer_text(tok, output_ids: list[int], eos: set[int]) -> str:
    ids = output_ids[:-1] if output_ids and output_ids[-1] in eos else output_ids
    return tok.decode(ids, skip_special_tokens=True)


def _first_difference(pid, turn, ids, bids, out, bout, base_top: list[dict] | None = None) -> dict:
    """Where two greedy generations part.  With the baseline's top logprobs per token (a server
    baseline), also those at that token and the baseline's margin over the speculative choice
    (None if that choice is not among them): a small margin is a near-tie, which batched
    verification in bf16 may resolve the other way."""
    if ids != bids:
        return {"id": pid, "turn": turn, "where": "prompt (an earlier turn already differed)"}
    i = next((k for k, (x, y) in enumerate(zip(out, bout)) if x != y), min(len(out), len(bout)))
    d = {"id": pid, "turn": turn, "where": f"token {i}", "position": i, "spec": out[i : i + 4], "baseline": bout[i : i + 4]}
    if base_top is not None and i < min(len(out), len(bout)) and i < len(base_top):
        top = base_top[i]
        d["baseline_top_logprobs"] = {str(t): lp for t, lp in top.items()}
        d["logprob_gap"] = top[bout[i]] - top[out[i]] if bout[i] in top and out[i] in top else None
    return d


# ----------------------------------------------------------------------------------------------
# the command


def evaluate(args) -> dict:
    """Run the chosen engine's evaluator, add the common fields, write REPORT.json atomically."""
    from eaglenest.utils import atomic_write_json, machine_info

    evs = engine_evaluators()
    if args.engine not in evs:
        raise EaglenestError(f"unknown engine '{args.engine}' (available: {', '.join(sorted(evs))})")
    if args.engine == "sglang" and float(args.temperature) > 0 and draft_sampling(args) != "argmax":
        raise EaglenestError("SGLang verifies the draft's argmax (top-k) candidates at temperature > 0, never tokens "
                             "sampled from the draft: pass --draft-sampling argmax with --engine sglang")
    from eaglenest.export.check import assert_draft_ok

    # the draft directory is read here once; the evaluators take `args.draft_dir` (None: a server engine's draft
    # that lives on the server only)
    args.draft_dir = read_draft_dir(args.draft) if (Path(args.draft) / "config.json").exists() else None
    resolve_draft_steps(args)
    if args.draft_dir is not None:
        for w in assert_draft_ok(args.draft_dir, args.model, engines=(args.engine,), weights=False):  # as this engine reads it
            print(f"warning: {w}", file=sys.stderr)
    t0 = time.perf_counter()
    report = evs[args.engine](args)
    report.setdefault("engine", args.engine)
    report.setdefault("batch_size", 1)
    report["date"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    report["elapsed_s"] = round(time.perf_counter() - t0, 2)
    report["machine"] = machine_info()
    atomic_write_json(args.out, report)
    return report


def greedy_summary(r: dict) -> str:
    """The greedy-equality verdict with what it covers ("yes, 20 of 80 generations compared")."""
    match = r.get("greedy_matches_baseline")
    if match is None:
        return "-"
    of = f"{r['texts_compared']} of {r['n_generations']} generations compared"
    return f"yes, {of}" if match else f"NO ({len(r.get('greedy_mismatches', []))} differ; {of})"


DEFAULT_STEPS = 3  # an EAGLE draft's chain when --steps is not given


def resolve_draft_steps(args) -> None:
    """Set args.steps (every evaluator reads it): `--steps` as given, else the draft's default --
    3, or what its kind says (a DFlash draft: block_size - 1, one block per round in a chain; it
    refuses any other --steps: a shorter block would not be the function it was trained as)."""
    given = args.steps
    args.steps = DEFAULT_STEPS if given is None else int(given)
    d = getattr(args, "draft_dir", None)
    if d is None:
        if not (Path(args.draft) / "config.json").exists():
            return
        d = read_draft_dir(args.draft)
    steps = d.kind.eval_steps(args, d.cfg, given)
    if steps is not None:
        args.steps = steps


def format_table(r: dict) -> str:
    def f(x, spec=".2f", suffix=""):
        return "-" if x is None else f"{x:{spec}}{suffix}"

    acc = " ".join(f(x) for x in r.get("accept_per_position") or [])
    rows = [
        ("engine / dtype / device", f"{r.get('engine')} / {r.get('dtype', '-')} / {r.get('device', '-')}"),
        ("dataset", f"{r.get('dataset')}  ({r.get('n_prompts')} prompts x {r.get('turns')} turn(s), batch {r.get('batch_size')})"),
        ("steps / topk / draft tokens", f"{r.get('steps')} / {r.get('topk')} / {r.get('num_draft_tokens')}"),
        ("temperature / max new tokens", f"{r.get('temperature')} / {r.get('max_new_tokens')}"),
        ("tau (tokens per verify step)", f(r.get("tau"))),
        ("accepted at draft position", acc or "-"),
        ("generated tokens / verify steps", f"{r.get('generated_tokens')} / {r.get('verify_steps')}"),
        ("spec tokens/s", f(r.get("spec_tokens_per_s"), ".1f")),
        ("baseline tokens/s", f(r.get("baseline_tokens_per_s"), ".1f")),
        ("speedup", f(r.get("speedup"), ".2f", "x")),
        ("draft cost per round", f(r.get("draft_ms_per_round"), ".1f", " ms")),
        ("greedy output == baseline", greedy_summary(r)),
    ]
    if "verification" in r:  # hf engine: how verification was made exact (or not), see verification.py
        from eaglenest.evaluate.verification import summary

        rows.append(("verification", summary(r["verification"])))
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def main_eval(args) -> int:
    report = evaluate(args)
    print(format_table(report))
    print(f"report: {args.out}", file=sys.stderr)
    return 0
