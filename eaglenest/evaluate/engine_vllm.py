"""`eaglenest eval --engine vllm`: serve the target with our exported draft in vLLM and measure tau.

  * A server is started (127.0.0.1, free port, the vLLM venv) with
    `--speculative-config {"method": "eagle3", "model": DRAFT_DIR, "num_speculative_tokens": steps}`
    (vLLM drafts a chain: --topk 1 only; draft tokens = steps + 1); at temperature > 0 also
    `"draft_sample_method"`: probabilistic for `--draft-sampling sample` (our decoder's standard
    rule), greedy for `argmax`.  A DFlash draft is served with `"method": "dflash"` and steps = its
    block_size - 1 (evaluate/run.py resolve_draft_steps).
  * The benchmark prompts go one at a time (batch size 1, like the in-process evaluator) as token
    ids from the target's chat template (`chat_prompt_ids`), greedy unless --temperature;
    `--engine-arg concurrency=N`: N conversations at a time (the server batches them), the counters
    then read only around the whole run (tau and the acceptance of all generations together, none
    per prompt).
  * tau comes from the server's Prometheus counters, snapshotted before and after each request:
    tau = 1 + d(vllm:spec_decode_num_accepted_tokens_total) / d(vllm:spec_decode_num_drafts_total),
    and the acceptance at draft position i = d(..._num_accepted_tokens_per_pos_total{position=i}) /
    d(drafts).  In the report's terms: verify_steps = d(drafts), verified_tokens = d(drafts) +
    d(accepted) (tokens emitted by verification forwards, the prefill's token excluded), which is
    exactly how the in-process evaluator counts.
  * Then the same server without speculation answers the same prompts; at temperature 0 the
    outputs are compared token by token (`greedy_matches_baseline`).  vLLM verifies k tokens in
    one batched bf16 forward, which is not bit-identical to decoding them one by one, so two
    runs may part at a near-tie: the baseline asks for its top-2 logprobs, and each mismatch
    records them at the first differing token (`baseline_top_logprobs`, `logprob_gap`).

Options for this evaluator come as `--engine-arg KEY=VALUE`: python (the vLLM venv's python),
startup_timeout (s), max_model_len, log_dir (keep the server logs there), server_arg (one extra
server argument; `server_arg=--max-num-seqs=4`), timeout (s, per request), concurrency (requests in flight,
default 1, see above).  The report has the in-process evaluator's keys
plus `vllm_*` extras.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from eaglenest import EaglenestError

DRAFTS = "vllm:spec_decode_num_drafts_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


def spec_counters(metrics: dict[str, float], steps: int) -> dict:
    """The spec-decode counters out of a parsed /metrics (summed over engines/labels)."""
    per_pos = [0.0] * steps
    for key, v in metrics.items():
        if key.startswith(PER_POS + "{"):
            label = key.split('position="', 1)
            if len(label) == 2:
                pos = int(label[1].split('"', 1)[0])
                if pos < steps:
                    per_pos[pos] += v
    return {
        "drafts": metrics.get(DRAFTS, 0.0),
        "accepted": metrics.get(ACCEPTED, 0.0),
        "draft_tokens": metrics.get(DRAFT_TOKENS, 0.0),
        "per_pos": per_pos,
    }


def counter_delta(before: dict, after: dict) -> dict:
    """What the server counted between two snapshots, in the report's terms: verify_steps = d(drafts),
    verified_tokens = d(drafts) + d(accepted), accepted_per_position = d(per position)."""
    d = after["drafts"] - before["drafts"]
    return {"verify_steps": int(round(d)), "verified_tokens": int(round(d + after["accepted"] - before["accepted"])),
            "accepted_per_position": [int(round(x - y)) for x, y in zip(after["per_pos"], before["per_pos"])]}


def settled_counters(client, steps: int, tries: int = 40) -> dict:
    """Read the counters until two reads agree (the stat logger can trail the HTTP response)."""
    from eaglenest.engines.vllm import metrics

    prev = spec_counters(metrics(client), steps)
    for _ in range(tries):
        time.sleep(0.05)
        cur = spec_counters(metrics(client), steps)
        if cur == prev:
            return cur
        prev = cur
    return prev


def top_logprobs(choice: dict) -> list[dict[int, float]]:
    """A /v1/completions choice's `logprobs.top_logprobs` (keys "token_id:ID") -> [{id: logprob}]."""
    rows = ((choice.get("logprobs") or {}).get("top_logprobs")) or []
    return [{int(k.split(":", 1)[1]): float(v) for k, v in (row or {}).items() if k.startswith("token_id:")} for row in rows]


def _target_config(path: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def run_eval(args) -> dict:
    from eaglenest.capture.layers import default_layer_ids
    from eaglenest.engines.http import Client, RequestFailed
    from eaglenest.engines.server import ServerProcess
    from eaglenest.engines.vllm import find_vllm_python, finish_generated, model_card, server_command, start_server
    from eaglenest.evaluate.run import (
        chat_prompt_ids, check_draft_fits, draft_sampling, finish_report, load_prompts, merge_server_baseline, read_draft_dir,
        report_header, run_conversations,
    )
    from eaglenest.engines.vllm_fixes import reported
    from eaglenest.models.target import eos_token_ids, load_tokenizer, resolve_model_path

    a = args
    ea = dict(getattr(a, "engine_args", None) or {})
    steps, topk, temp = int(a.steps), int(a.topk), float(a.temperature)
    try:
        conc = int(ea.get("concurrency", 1))
    except ValueError:
        conc = 0
    if conc < 1:
        raise EaglenestError(f"--engine-arg concurrency must be a whole number >= 1 (got {ea.get('concurrency')!r})")
    if topk != 1:
        raise EaglenestError("vLLM drafts EAGLE-3 as a chain: use --topk 1 with --engine vllm")
    if a.num_draft_tokens not in (None, steps + 1):
        raise EaglenestError(f"vLLM verifies steps+1 = {steps + 1} tokens per round; drop --num-draft-tokens")
    dataset, prompts = load_prompts(a)

    path = resolve_model_path(a.model)
    tok = load_tokenizer(a.model, getattr(a, "trust_remote_code", False))
    tcfg = _target_config(path)
    d = read_draft_dir(getattr(a, "draft_dir", None) or Path(a.draft).resolve())  # read once by evaluate()
    draft_dir, dcfg = d.path.resolve(), d.cfg
    if not dcfg.aux_layer_ids:
        dcfg.aux_layer_ids = default_layer_ids(tcfg.num_hidden_layers)
    check_draft_fits(dcfg, tcfg, where=f"draft {draft_dir}")
    eos = set(eos_token_ids(path, tok))
    eos_list = sorted(eos)

    python = find_vllm_python(ea.get("python"))
    workdir = Path(ea["log_dir"]) if ea.get("log_dir") else Path(tempfile.mkdtemp(prefix="eaglenest-vllm-eval-"))
    workdir.mkdir(parents=True, exist_ok=True)
    max_len = int(ea.get("max_model_len") or min(int(getattr(tcfg, "max_position_embeddings", 4096) or 4096), 4096))
    extra = [ea["server_arg"]] if ea.get("server_arg") else []
    startup = float(ea.get("startup_timeout", 600))
    spec_cfg = {"method": d.kind.vllm_method, "model": str(draft_dir), "num_speculative_tokens": steps}
    if temp > 0:  # how vLLM drafts at temperature > 0, as --draft-sampling says (vLLM's own default: greedy)
        spec_cfg["draft_sample_method"] = "probabilistic" if draft_sampling(a) == "sample" else "greedy"

    def serve(spec: bool, name: str) -> ServerProcess:
        return start_server(
            lambda port: server_command(python, path, port=port, dtype=a.dtype, max_model_len=max_len,
                                        speculative_config=spec_cfg if spec else None, extra=extra),
            workdir=workdir / name, startup_timeout=startup,
        )

    def ask(client: Client, model: str, ids: list[int], top: int = 0):
        room = min(a.max_new_tokens, max_len - len(ids))
        if room < 1:
            raise EaglenestError(f"a prompt of {len(ids)} tokens does not fit max_model_len {max_len}")
        payload = {"model": model, "prompt": ids, "max_tokens": room, "temperature": temp, "top_p": 1.0, "top_k": 0,
                   "seed": int(a.seed), "return_token_ids": True, "skip_special_tokens": False, "stop_token_ids": eos_list}
        if top:  # per generated token, the top logprobs keyed "token_id:ID"
            payload.update(logprobs=top, return_tokens_as_token_ids=True)
        t0 = time.perf_counter()
        try:
            resp = client.request("POST", "/v1/completions", payload, tag="eval")
        except RequestFailed as e:
            raise EaglenestError(f"vLLM request failed: {e.message}") from None
        wall = time.perf_counter() - t0
        ch = (resp.get("choices") or [{}])[0]
        if ch.get("prompt_token_ids") != ids:
            raise EaglenestError("vLLM echoed other prompt ids than were sent (token_mismatch)")
        g = finish_generated("", ids, list(ch.get("token_ids") or []), ch.get("finish_reason"), ch.get("stop_reason"), eos_list)
        return g, wall, resp.get("system_fingerprint"), top_logprobs(ch) if top else None

    def run_all(client: Client, spec: bool, desc: str) -> tuple[list[dict], str | None, dict | None]:
        """(records, vLLM version, totals): one request at a time, counters per request (totals None);
        with concurrency > 1 the counters only of the whole run (totals), records without them."""
        model = model_card(client, client.urls[0])["id"]
        warm = chat_prompt_ids(tok, [{"role": "user", "content": "Hello!"}])
        ask(client, model, warm)  # warm-up: not timed, and the counters are snapshotted per request
        version = None
        top = 2 if not spec and temp <= 0 else 0  # the greedy baseline: evidence for any near-tie divergence
        per_request = spec and conc == 1
        start = settled_counters(client, steps) if spec and not per_request else None

        def answer(p, turn: int, ids: list[int]) -> dict:
            nonlocal version
            before = settled_counters(client, steps) if per_request else None
            g, wall, version, lps = ask(client, model, ids, top)
            rec = {"id": p.id, "turn": turn, "prompt_ids": ids, "output_ids": g.output_ids,
                   "finish_reason": g.finish_reason, "wall_s": wall, "generated_tokens": len(g.output_ids)}
            if lps is not None:
                rec["top_logprobs"] = lps
            if per_request:
                n = counter_delta(before, settled_counters(client, steps))
                rec.update(n, tau=n["verified_tokens"] / n["verify_steps"] if n["verify_steps"] else None)
            return rec

        recs = run_conversations(prompts, a.turns, tok, eos, desc, answer, concurrency=conc)
        if start is None:
            return recs, version, None
        return recs, version, counter_delta(start, settled_counters(client, steps))

    server_times: dict[str, float] = {}

    def serve_and_run(spec: bool, name: str) -> tuple[list[dict], str | None, str, dict | None]:
        """Start the server, answer every prompt, stop it: (records, version, server log, totals)."""
        server = serve(spec, name)
        try:
            server_times[name] = server.start_seconds or 0.0
            # the plugin speaks while vLLM's processes start, so a server without it is refused before any decoding
            if spec and temp > 0 and not reported(server.log_path.read_text(errors="replace")):
                raise EaglenestError(
                    f"the vLLM server did not load eaglenest's plugin (its log {server.log_path} has no line from "
                    "eaglenest/engines/vllm_fixes.py; is VLLM_PLUGINS set without 'eaglenest_cpu_expand_fix'?): on a CPU "
                    "vLLM 0.32 speculative sampling at temperature > 0 is then corrupt (docs/vllm.md), so no result is reported")
            client = Client([server.url], timeout=float(ea.get("timeout", 900)), retries=1, concurrency=conc)
            try:
                recs, version, totals = run_all(client, spec, f"eval vllm {name}")
            finally:
                client.close()
            return recs, version, server.log_path.read_text(errors="replace") if server.log_path.exists() else "", totals
        finally:
            server.stop()

    records, version, log_text, totals = serve_and_run(True, "spec")
    base_records = None if a.no_baseline else serve_and_run(False, "baseline")[0]

    mismatches = merge_server_baseline(records, base_records, greedy=temp <= 0)

    report = report_header("vllm", a, dataset, len(prompts), records, steps=steps, topk=1, ndt=steps + 1, path=path,
                           aux_ids=dcfg.aux_layer_ids, draft_vocab=dcfg.draft_vocab_size, device="cpu (vLLM)",
                           attention="vllm")  # vLLM's own attention backend for the platform
    finish_report(report, records, steps, mismatches, totals)
    # requests in flight at once; above 1, tau and the acceptance are of the whole run (the counters are
    # the server's), so the per-prompt records carry no tau
    report["batch_size"] = conc
    report["vllm_version"] = version
    report["vllm_speculative_config"] = spec_cfg
    report["vllm_server_start_s"] = server_times
    report["vllm_tau_source"] = "1 + d(vllm:spec_decode_num_accepted_tokens_total) / d(vllm:spec_decode_num_drafts_total)"
    report["vllm_draft_shares_target_embeddings"] = "without its own embed_tokens" in log_text
    # what our plugin (engines/vllm_fixes.py) did in the server's processes: repaired or left vLLM's CPU fallback
    report["vllm_fixes"] = reported(log_text)
    # the prefill's token is not verified: generated = verified + 1 per generation, unless a
    # verification round overshot max_new_tokens / eos (vLLM counts what it accepted)
    report["vllm_unaccounted_tokens"] = report["generated_tokens"] - len(records) - report["verified_tokens"]
    if not ea.get("log_dir"):
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"eval vllm: server logs under {workdir}", file=sys.stderr)
    return report
