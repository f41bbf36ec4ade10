"""`eaglenest eval --engine sglang (--sglang-url URL | --sglang-serve)`: tau of a draft served by SGLang.

Either a running server with the draft (SGLang 0.5.23 flags; see docs/sglang.md):

    python -m sglang.launch_server --model-path TARGET --speculative-algorithm EAGLE3 \\
        --speculative-draft-model-path DRAFT_DIR --speculative-num-steps S \\
        --speculative-eagle-topk K --speculative-num-draft-tokens D

or, with `--sglang-serve`, SGLang's CPU engine started here (from .venv-sglang, 127.0.0.1, a free
port) twice: with the draft, then without it for the baseline.

The benchmark prompts go one at a time (batch size 1, like the other evaluators) to `POST /generate`
as token ids from the target's chat template (`chat_prompt_ids`), greedy unless --temperature.
For every finished request SGLang 0.5.23 reports `meta_info.completion_tokens` and, when a draft
proposed tokens, `meta_info.spec_verify_ct` (target verification forwards),
`spec_num_correct_drafts` and `spec_correct_drafts_histogram` (steps by number of accepted draft
tokens) -- `TokenizerManager._calculate_spec_decoding_metrics`.  The report's tau is SGLang's own
acceptance length summed over the prompts:

    tau = sum(completion_tokens) / sum(spec_verify_ct)

(`verified_tokens` = completion_tokens, `verify_steps` = spec_verify_ct).  Note that
completion_tokens includes the token the prefill emits, which no verification step produced; the
tau of the in-process and vLLM evaluators leaves it out.  That figure is reported as well:
`sglang_tau_verify_only` = sum(spec_verify_ct + spec_num_correct_drafts) / sum(spec_verify_ct).
Acceptance at draft position i = steps that accepted more than i draft tokens / verify steps (from
the histogram).

Options: `--sglang-url URL` or `--engine-arg url=URL`; `--engine-arg baseline_url=URL` (a server
without the draft: speedup and, at temperature 0, the greedy-equivalence check), `--engine-arg
timeout=S`, `--engine-arg retries=N`; with `--sglang-serve`: `--engine-arg python=PY`,
`startup_timeout=S`, `log_dir=DIR` (keep the server logs there), `server_arg=ARG`.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from eaglenest import EaglenestError

TAU_SOURCE = "sum(meta_info.completion_tokens) / sum(meta_info.spec_verify_ct)"


def add_arguments(p) -> None:
    """Flags of this evaluator for `eval`."""
    p.add_argument("--sglang-url", action="append", default=None, metavar="URL",
                   help="sglang evaluator: base URL of a running SGLang server serving the draft (EAGLE3)")
    p.add_argument("--sglang-serve", action="store_true",
                   help="sglang evaluator: start SGLang's CPU engine here with the draft (and again without it for "
                   "the baseline), stop it at the end")


def _urls(args) -> tuple[list[str], list[str]]:
    ea = dict(getattr(args, "engine_args", None) or {})
    urls = list(getattr(args, "sglang_url", None) or [])
    if ea.get("url"):
        urls += [u for u in ea["url"].split(",") if u]
    base = [u for u in (ea.get("baseline_url") or "").split(",") if u]
    from eaglenest.engines.sglang.flags import check_server_choice

    check_server_choice(urls, getattr(args, "sglang_serve", False), "eval --engine sglang needs a running server "
                        "(--sglang-url URL or --engine-arg url=URL; launch flags: docs/sglang.md)")
    return urls, base


def accepted_per_position(hist: list[int] | None, steps: int) -> list[int]:
    """Verify steps in which draft position i was accepted (more than i drafts accepted)."""
    hist = list(hist or [])
    return [sum(c for n, c in enumerate(hist) if n > i) for i in range(steps)]


def spec_record(meta: dict, steps: int) -> dict:
    ct = int(meta.get("spec_verify_ct") or 0)
    completion = int(meta.get("completion_tokens") or 0)
    correct = int(meta.get("spec_num_correct_drafts") or 0)
    return {
        "verify_steps": ct,
        "verified_tokens": completion if ct else 0,
        "accepted_per_position": accepted_per_position(meta.get("spec_correct_drafts_histogram"), steps),
        "tau": completion / ct if ct else None,
        "correct_drafts": correct,
    }


def _server_spec(info: dict) -> dict:
    from eaglenest.engines.sglang.preflight import find_key

    return {k: find_key(info, k) for k in ("speculative_algorithm", "speculative_num_steps", "speculative_eagle_topk",
                                           "speculative_num_draft_tokens", "speculative_draft_model_path")}


def run_eval(args) -> dict:
    from eaglenest.capture.layers import default_layer_ids
    from eaglenest.engines.base import Failure
    from eaglenest.engines.http import Client, RequestFailed
    from eaglenest.engines.sglang.protocol import (
        GENERATE_RID_PREFIX,
        check_item,
        finish,
        generate_payload,
        generate_sampling,
        response_items,
    )
    from eaglenest.evaluate.run import chat_prompt_ids, finish_report, load_prompts, merge_server_baseline, report_header, run_conversations
    from eaglenest.evaluate.specdec import resolve_num_draft_tokens
    from eaglenest.kinds import registry
    from eaglenest.models.target import eos_token_ids, load_config, load_tokenizer, resolve_model_path

    a = args
    ea = dict(getattr(a, "engine_args", None) or {})
    urls, base_urls = _urls(a)
    steps, topk, temp = int(a.steps), int(a.topk), float(a.temperature)
    ndt = resolve_num_draft_tokens(steps, topk, a.num_draft_tokens)
    dataset, prompts = load_prompts(a)
    path = resolve_model_path(a.model)
    tok = load_tokenizer(a.model, getattr(a, "trust_remote_code", False))
    tcfg = load_config(a.model, getattr(a, "trust_remote_code", False))
    eos = set(eos_token_ids(path, tok))
    eos_list = sorted(eos)
    aux_ids, draft_vocab, kind = None, None, None
    draft_dir = Path(a.draft)
    d = getattr(a, "draft_dir", None)  # read once by evaluate()
    if d is not None or (draft_dir / "config.json").exists():
        from eaglenest.evaluate.run import check_draft_fits, read_draft_dir

        dd = read_draft_dir(d or draft_dir)
        dcfg, kind = dd.cfg, dd.kind
        if not dcfg.aux_layer_ids:
            dcfg.aux_layer_ids = default_layer_ids(tcfg.num_hidden_layers)
        check_draft_fits(dcfg, tcfg, where=f"draft {draft_dir}")
        aux_ids, draft_vocab = list(dcfg.aux_layer_ids), dcfg.draft_vocab_size
    else:
        print(f"eval sglang: {draft_dir} is not readable here; the report takes the draft as the server loaded it",
              file=sys.stderr)

    timeout, retries = float(ea.get("timeout", 900)), int(ea.get("retries", 1))
    # the algorithm the server runs the draft with: its kind's (a draft not readable here: the default
    # kind's, what other trainers' drafts are)
    algorithm = (kind or registry.get(None)).sglang_algorithm
    serve = getattr(a, "sglang_serve", False)
    served = _Served(a, ea, path, draft_dir, algorithm, steps, topk, ndt) if serve else None
    if served is not None:
        urls = [served.start(spec=True)]
    client = Client(urls, timeout=timeout, retries=retries, concurrency=1)
    version, server_spec = None, {}
    try:
        info = client.get_json("/server_info", urls[0])
        version = info.get("version")
        server_spec = _server_spec(info)
    except RequestFailed as e:
        print(f"eval sglang: warning: {urls[0]}/server_info: {e.message}", file=sys.stderr)
    want = {"speculative_num_steps": steps, "speculative_eagle_topk": topk, "speculative_num_draft_tokens": ndt}
    differ = {k: (server_spec.get(k), v) for k, v in want.items() if server_spec.get(k) is not None and server_spec[k] != v}
    if differ:
        raise EaglenestError("the server decodes with " + ", ".join(f"{k}={s}" for k, (s, _) in differ.items())
                             + " but this run says " + ", ".join(f"{k}={w}" for k, (_, w) in differ.items())
                             + ": pass the server's --steps/--topk/--num-draft-tokens")
    if server_spec.get("speculative_algorithm") not in (None, algorithm):
        raise EaglenestError(f"the server runs speculative algorithm {server_spec['speculative_algorithm']!r}, not "
                             f"{algorithm} ({(kind or registry.get(None)).title})")

    counter = iter(range(1 << 62))

    def ask(c: Client, ids: list[int]):
        sampling = generate_sampling(a.max_new_tokens, temp, int(a.seed), eos_list)
        sent = {}

        def make(attempt):
            sent["rid"] = f"{GENERATE_RID_PREFIX}eval-{next(counter)}-a{attempt}"
            return generate_payload([ids], [sent["rid"]], sampling)

        t0 = time.perf_counter()
        try:
            resp = c.request("POST", "/generate", make_payload=make, tag="eval")
        except RequestFailed as e:
            raise EaglenestError(f"SGLang request failed: {e.message}") from None
        wall = time.perf_counter() - t0
        item = response_items(resp, 1)[0]
        bad = check_item(item, sent["rid"], ids, "eval")
        g = bad or finish("eval", ids, item, eos_list)
        if isinstance(g, Failure):
            raise EaglenestError(f"SGLang answer rejected ({g.reason}): {g.message}")
        return g, item.get("meta_info") or {}, wall

    def run_all(c: Client, spec: bool, desc: str) -> list[dict]:
        ask(c, chat_prompt_ids(tok, [{"role": "user", "content": "Hello!"}]))  # warm-up, not reported

        def answer(p, turn: int, ids: list[int]) -> dict:
            g, meta, wall = ask(c, ids)
            rec = {"id": p.id, "turn": turn, "prompt_ids": ids, "output_ids": g.output_ids,
                   "finish_reason": g.finish_reason, "wall_s": wall, "generated_tokens": len(g.output_ids),
                   "completion_tokens": int(meta.get("completion_tokens") or len(g.output_ids))}
            if spec:
                rec.update(spec_record(meta, steps))
            return rec

        return run_conversations(prompts, a.turns, tok, eos, desc, answer)

    try:
        try:
            records = run_all(client, True, "eval sglang spec")
        except EaglenestError as e:
            raise EaglenestError(f"{e}{served.explain() if served else ''}") from None
        finally:
            client.close()
        if sum(r["verify_steps"] for r in records) == 0 and sum(r["generated_tokens"] for r in records) > len(records):
            raise EaglenestError("no meta_info.spec_verify_ct in any answer: is the server running the draft "
                                 f"(--speculative-algorithm {algorithm} --speculative-draft-model-path ...)?")
        base_records = None
        if served is not None and not a.no_baseline:
            base_urls = [served.start(spec=False)]
        if base_urls and not a.no_baseline:
            bclient = Client(base_urls, timeout=timeout, retries=retries, concurrency=1)
            try:
                base_records = run_all(bclient, False, "eval sglang baseline")
            finally:
                bclient.close()
    finally:
        if served is not None:
            served.close()

    mismatches = merge_server_baseline(records, base_records, greedy=temp <= 0)
    report = report_header("sglang", a, dataset, len(prompts), records, steps=steps, topk=topk, ndt=ndt, path=path,
                           aux_ids=aux_ids, draft_vocab=draft_vocab, device="SGLang server")
    finish_report(report, records, steps, mismatches)
    vsteps = sum(r["verify_steps"] for r in records)
    report["sglang_version"] = version
    report["sglang_urls"] = urls
    report["sglang_server_spec"] = server_spec
    report["sglang_tau_source"] = TAU_SOURCE
    report["sglang_tau_verify_only"] = ((vsteps + sum(r["correct_drafts"] for r in records)) / vsteps) if vsteps else None
    if served is not None:
        report["sglang_server_start_s"] = served.start_seconds
    return report


class _Served:
    """The CPU servers `--sglang-serve` starts: one with the draft, then one without (baseline)."""

    def __init__(self, a, ea: dict, path, draft_dir, algorithm: str, steps: int, topk: int, ndt: int):
        import tempfile

        from eaglenest.engines.sglang.server import find_sglang_python

        self.a, self.path = a, path
        self.python = find_sglang_python(ea.get("python"))
        self.spec = {"algorithm": algorithm, "draft": Path(draft_dir).resolve(), "steps": steps, "topk": topk, "draft_tokens": ndt}
        self.keep = bool(ea.get("log_dir"))
        self.workdir = Path(ea["log_dir"]) if self.keep else Path(tempfile.mkdtemp(prefix="eaglenest-sglang-eval-"))
        self.startup = float(ea.get("startup_timeout", 600))
        self.extra = [ea["server_arg"]] if ea.get("server_arg") else []
        self.server = None
        self.start_seconds: dict[str, float] = {}

    def start(self, spec: bool) -> str:
        from eaglenest.engines.sglang.server import server_command, start_server

        self.stop()
        name = "spec" if spec else "baseline"
        self.server = start_server(
            lambda port: server_command(self.python, self.path, port=port, dtype=self.a.dtype, mode="generate",
                                        speculative=self.spec if spec else None, extra=self.extra),
            workdir=self.workdir / name, startup_timeout=self.startup)
        self.start_seconds[name] = self.server.start_seconds or 0.0
        return self.server.url

    def explain(self) -> str:
        """The server log's last lines, for an error (e.g. the draft server dying on its first request)."""
        if self.server is None:
            return ""
        return f"; last lines of {self.server.log_path}:\n{self.server.log_tail(25)}"

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def close(self) -> None:
        self.stop()
        if self.keep:
            print(f"eval sglang: server logs under {self.workdir}", file=sys.stderr)
        else:
            import shutil

            shutil.rmtree(self.workdir, ignore_errors=True)
