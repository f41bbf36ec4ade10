"""The SGLang engine: a client of SGLang's native `POST /generate` (targets SGLang 0.5.23).

Servers: `--sglang-url URL` (repeatable) uses running servers, anywhere; `--sglang-serve` starts one
on this machine's CPU (server.py) and stops it at the end (logs kept with `--sglang-log`).  Requests
and response checks: protocol.py.  Facts below were read in SGLang 0.5.23's published source and
checked against a live 0.5.23 server (docs/sglang.md).

Capture modes (`--sglang-mode`):
  * `plugin` (default): the server runs eaglenest's capture plugin (`eaglenest sglang-plugin
    install`, or on the path of a server eaglenest starts), which writes one safetensors file per
    request and prefill chunk into a staging directory shared with this process (`--sglang-staging`,
    default /dev/shm/eaglenest).  A capture request generates 1 token (max_new_tokens=1,
    temperature 0, like SpecForge); the client then collects the rid's files, checks that the
    chunks cover the prompt from token 0 (a radix-cache hit would start later: `prefix_cached`),
    that the stored input ids equal the ids sent and the layer ids equal the engine's, loads them
    (safetensors, never pickle) and deletes them.
  * `stock`: an unmodified server started with `--enable-return-hidden-states` returns, in
    `meta_info.hidden_states`, the *post-norm final* state only (JSON floats).  It cannot fill the
    aux states: capture in this mode needs `--sglang-aux-url` servers started with
    `--enable-return-aux-hidden-states --speculative-algorithm EAGLE3
    --return-aux-hidden-state-layer-ids IDS` (0.5.23), whose `hidden_states` are the aux concat
    [T, n*H] instead (any number of layers: SGLang maps each id with the target class's EAGLE-3
    rule, export/layer_ids.py); each sample then costs one request to each kind of server.  The
    preflight reads the aux servers' ids from `/server_info` and refuses servers that capture other
    layers than this run's.  Without aux servers, capture stops with an error saying so.
    Generation (regenerate) works in both modes.

Requests go through the shared client (`engines/http.py`): spread round-robin over the URLs, at most
`--sglang-concurrency` in flight, batched `--sglang-batch` samples per request; timeouts, 5xx and
connection errors are retried with exponential backoff and jitter (a fresh rid per attempt), then
the samples fail with the reason.
"""

from __future__ import annotations

import glob
import itertools
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from eaglenest import EaglenestError
from eaglenest.capture.layers import parse_layer_ids
from eaglenest.engines.base import Captured, Engine, EngineInfo, Failure, Generated, Request, check_echo
from eaglenest.engines.http import Client, RequestFailed, merge_stats
from eaglenest.engines.server import ServerProcess
from eaglenest.engines.sglang import plugin
from eaglenest.engines.sglang.flags import MODES, check_server_choice
from eaglenest.engines.sglang.preflight import aux_server_problem, preflight_problems
from eaglenest.engines.sglang.protocol import (
    CAPTURE_RID_PREFIX,
    GENERATE_RID_PREFIX,
    STOCK_RID_PREFIX,
    TARGET_SGLANG_VERSION,
    capture_sampling,
    check_item,
    finish,
    generate_payload,
    generate_sampling,
    hidden_rows,
    response_items,
)
from eaglenest.engines.sglang.server import find_sglang_python, refuse_cpu_mla, server_command, start_server
from eaglenest.models.target import eos_token_ids, model_config

NAME = "sglang"


def create(args) -> "SGLangEngine":
    urls = getattr(args, "sglang_url", None) or []
    serve = getattr(args, "sglang_serve", False)
    check_server_choice(urls, serve, "--engine sglang needs --sglang-url URL (a running SGLang server; see docs/sglang.md)")
    return SGLangEngine(
        args.model,
        urls=urls,
        layers=getattr(args, "layers", "auto"),
        mode=getattr(args, "sglang_mode", "plugin"),
        aux_urls=getattr(args, "sglang_aux_url", None) or [],
        staging=getattr(args, "sglang_staging", None),
        concurrency=getattr(args, "sglang_concurrency", 4),
        batch=getattr(args, "sglang_batch", 8),
        timeout=getattr(args, "sglang_timeout", 600.0),
        retries=getattr(args, "sglang_retries", 3),
        dump_timeout=getattr(args, "sglang_dump_timeout", 60.0),
        preflight=not getattr(args, "sglang_skip_preflight", False),
        serve=serve,
        dtype=getattr(args, "dtype", "bf16"),
        python=getattr(args, "sglang_python", None),
        startup_timeout=getattr(args, "sglang_startup_timeout", 600.0),
        log_file=getattr(args, "sglang_log", None),
        extra_server_args=getattr(args, "sglang_arg", None) or [],
    )



class SGLangEngine(Engine):
    name = NAME

    def __init__(self, model, *, urls=(), layers="auto", mode="plugin", aux_urls=(), staging=None, concurrency=4,
                 batch=8, timeout=600.0, retries=3, dump_timeout=60.0, preflight=True, backoff=0.5, serve=False,
                 dtype="bf16", python=None, startup_timeout=600.0, log_file=None, extra_server_args=()):
        from eaglenest.models.target import resolve_model_path

        if mode not in MODES:
            raise EaglenestError(f"--sglang-mode must be one of {MODES} (got {mode!r})")
        if serve and mode == "stock":
            raise EaglenestError("--sglang-serve starts plugin-mode servers; stock mode needs --sglang-url servers "
                                 "(and --sglang-aux-url for capture)")
        if not serve and not urls:
            raise EaglenestError("no SGLang server: give --sglang-url URL or --sglang-serve")
        self.path = resolve_model_path(model)
        cfg = model_config(self.path)
        self.architecture = (cfg.get("architectures") or ["?"])[0]
        if serve:
            refuse_cpu_mla(cfg, self.path)
        self.num_layers = int(cfg["num_hidden_layers"])
        self.hidden_size = int(cfg["hidden_size"])
        self.vocab_size = int(cfg["vocab_size"])
        self.layer_ids = parse_layer_ids(layers, self.num_layers)
        self.eos_ids = eos_token_ids(self.path)
        self.mode = mode
        self.concurrency = max(1, int(concurrency))
        self.batch = max(1, int(batch))
        self.timeout, self.retries, self.backoff = float(timeout), int(retries), backoff
        self.dump_timeout = float(dump_timeout)
        self.preflight = preflight
        self.session = uuid.uuid4().hex[:12]
        self._counter = itertools.count()
        self._lock = threading.Lock()
        self.urls = list(urls)
        self.serve = bool(serve)
        self.dtype, self.python_arg = dtype, python
        self.startup_timeout, self.log_file = float(startup_timeout), log_file
        self.extra_server_args = list(extra_server_args or [])
        self._tmp = Path(tempfile.mkdtemp(prefix="eaglenest-sglang-")) if serve else None
        own_staging = serve and staging is None  # a fresh directory in shared memory, removed at the end
        self._own_staging = Path(tempfile.mkdtemp(prefix=f"eaglenest-sglang-{self.session}-", dir=_shm())) if own_staging else None
        self.staging = self._own_staging or Path(staging or plugin.DEFAULT_DIR)
        self.server: ServerProcess | None = None
        self.server_mode: str | None = None
        self._closed_stats: list[dict] = []
        self.client = self._new_client(self.urls) if self.urls else None
        self.aux_client = self._new_client(list(aux_urls)) if aux_urls else None
        self._checked = False
        self.server_versions: dict[str, str] = {}

    def _new_client(self, urls: list[str]) -> Client:
        return Client(urls, timeout=self.timeout, retries=self.retries, concurrency=self.concurrency, backoff=self.backoff)

    # -- servers we start (--sglang-serve)
    def _ensure(self, mode: str) -> Client:
        """The client for `mode` ("capture" | "generate"), starting or restarting our server if needed."""
        if not self.serve:
            return self.client
        server_mode = "plugin" if mode == "capture" else "generate"
        if self.server is not None and self.server_mode == server_mode and self.server.alive():
            return self.client
        self._stop_server()
        python = find_sglang_python(self.python_arg)
        capture = server_mode == "plugin"
        self.server = start_server(
            lambda port: server_command(python, self.path, port=port, dtype=self.dtype, mode=server_mode,
                                        extra=self.extra_server_args),
            workdir=self._tmp / server_mode, log_file=self.log_file, startup_timeout=self.startup_timeout,
            capture_dir=self.staging if capture else None,
            layer_ids=self.layer_ids if capture and self.layer_ids != plugin.default_layer_ids(self.num_layers) else None)
        self.server_mode = server_mode
        self.client = self._new_client([self.server.url])
        self._checked = False
        return self.client

    def start(self, mode: str = "capture") -> None:
        """Start (or check) our server for `mode` now rather than on first use (callers time the work
        without the start-up); a no-op with --sglang-url."""
        if mode not in ("capture", "generate"):
            raise ValueError(mode)
        self._ensure(mode)

    def _stop_server(self) -> None:
        if self.server is None:
            return
        self._closed_stats.append(self.client.stats())
        self.client.close()
        self.client = None
        self.server.stop()
        self.server = self.server_mode = None

    # -- bookkeeping
    def _rid(self, prefix: str, attempt: int) -> str:
        with self._lock:
            n = next(self._counter)
        return f"{prefix}{self.session}-{n}-a{attempt}"

    def info(self) -> EngineInfo:
        # SGLang's model forward returns the state after the final norm
        return self._server_info("post", self.dtype if self.serve else None, urls=self.urls or "started", mode=self.mode,
                                 target_sglang_version=TARGET_SGLANG_VERSION)

    def request_stats(self) -> dict:
        live = [c.stats() for c in (self.client, self.aux_client) if c is not None]
        return merge_stats(*self._closed_stats, *live)

    def close(self) -> None:
        self._stop_server()
        for c in (self.client, self.aux_client):
            if c is not None:
                c.close()
        if self.mode == "plugin" and self.staging.is_dir():
            # late files of attempts that timed out on our side
            for f in glob.glob(str(self.staging / f"{glob.escape(CAPTURE_RID_PREFIX + self.session)}-*")):
                _remove(f)
        if self._own_staging is not None:
            shutil.rmtree(self._own_staging, ignore_errors=True)
        if self._tmp is not None:
            if self.log_file is None:
                shutil.rmtree(self._tmp, ignore_errors=True)

    def _chunks(self, items: list) -> list[list]:
        return [items[i:i + self.batch] for i in range(0, len(items), self.batch)]

    # -- preflight
    def _check_servers(self) -> None:
        if self._checked or not self.preflight:
            self._checked = True
            return
        if self.mode == "plugin" and self.architecture not in plugin.ARCHITECTURES:
            raise EaglenestError(
                f"the capture plugin does not observe {self.architecture} models: it observes the SGLang model classes of "
                f"{', '.join(sorted(plugin.ARCHITECTURES))} (docs/sglang.md); use --sglang-mode stock or --engine hf/vllm")
        clients = [(self.client, self.mode)] + ([(self.aux_client, "stock")] if self.aux_client else [])
        for client, mode in clients:
            for url in client.urls:
                try:
                    info = client.get_json("/server_info", url)
                except RequestFailed as e:
                    raise EaglenestError(f"{url}/server_info: {e.message} (is it an SGLang server? skip this check "
                                         "with --sglang-skip-preflight)") from None
                self.server_versions[url] = str(info.get("version"))
                errors, warnings = preflight_problems(info, mode)
                if client is self.aux_client and (bad := aux_server_problem(info, self.architecture, self.num_layers,
                                                                           self.layer_ids)) is not None:
                    errors.append(f"aux server {bad}")
                for w in warnings:
                    print(f"sglang: warning: {url}: {w}", file=sys.stderr)
                if errors:
                    raise EaglenestError(f"{url}: " + "; ".join(errors) + " (see docs/sglang.md for the launch command)")
        if self.mode == "plugin":
            self._check_marker()
        self._checked = True

    def _check_marker(self) -> None:
        mk = self.staging / plugin.MARKER_FILE
        if not mk.exists():
            raise EaglenestError(
                f"no {plugin.MARKER_FILE} in {self.staging}: the server is not running eaglenest's capture plugin with "
                f"{plugin.ENV_DIR}={self.staging} on this machine (install: `eaglenest sglang-plugin install --python "
                "SGLANG_PYTHON`; see docs/sglang.md), or pass --sglang-staging")
        try:
            m = json.loads(mk.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise EaglenestError(f"{mk}: unreadable ({e})") from None
        if m.get("rid_prefix") != CAPTURE_RID_PREFIX:
            raise EaglenestError(f"the plugin observes rids starting with {m.get('rid_prefix')!r}, this client sends "
                                 f"{CAPTURE_RID_PREFIX!r}: unset {plugin.ENV_RID_PREFIX} on the server")
        lids = m.get("layer_ids")
        if lids not in (None, "auto") and list(lids) != list(self.layer_ids):
            raise EaglenestError(f"the plugin captures layers {lids}, this run wants {self.layer_ids} (set "
                                 f"{plugin.ENV_LAYERS} on the server or --layers here)")
        if lids == "auto" and self.layer_ids != plugin.default_layer_ids(self.num_layers):
            raise EaglenestError(f"the plugin captures the canonical layers {plugin.default_layer_ids(self.num_layers)}, "
                                 f"this run wants {self.layer_ids}: start the server with "
                                 f"{plugin.ENV_LAYERS}={','.join(map(str, self.layer_ids))}")
        if m.get("sglang_version") != TARGET_SGLANG_VERSION:
            print(f"sglang: warning: the plugin runs in SGLang {m.get('sglang_version')}, it targets "
                  f"{TARGET_SGLANG_VERSION} (`eaglenest sglang-plugin check`)", file=sys.stderr)

    # -- one batched request, with fresh rids per attempt
    def _post(self, client: Client, reqs: list[Request], prefix: str, sampling: dict, *, extra_key: bool,
              hidden: bool, rid_log: list) -> tuple[list[str], list[dict]]:
        def make(attempt: int) -> dict:
            rids = [self._rid(prefix, attempt) for _ in reqs]
            rid_log.append(rids)
            return generate_payload([r.input_ids for r in reqs], rids, sampling,
                                    extra_keys=list(rids) if extra_key else None, return_hidden_states=hidden)

        resp = client.request("POST", "/generate", make_payload=make, tag=",".join(r.id for r in reqs))
        return rid_log[-1], response_items(resp, len(reqs))

    def _post_isolating(self, client, reqs, prefix, sampling, *, extra_key, hidden):
        """[(rid, item) | Failure] per request; a 4xx on a multi-sample batch is retried one by one
        so that one bad sample does not fail its neighbours."""
        rid_log: list = []
        try:
            rids, items = self._post(client, reqs, prefix, sampling, extra_key=extra_key, hidden=hidden, rid_log=rid_log)
            return list(zip(rids, items)), rid_log
        except RequestFailed as e:
            if len(reqs) > 1 and e.status is not None and 400 <= e.status < 500:
                out = []
                for r in reqs:
                    res, log_r = self._post_isolating(client, [r], prefix, sampling, extra_key=extra_key, hidden=hidden)
                    rid_log.extend(log_r)
                    out.extend(res)
                return out, rid_log
            return [Failure(r.id, e.reason, e.message) for r in reqs], rid_log

    # -- capture
    def capture(self, batch: list[Request]) -> list[Captured | Failure]:
        if self.mode == "stock" and self.aux_client is None:
            raise EaglenestError(
                "stock SGLang (--enable-return-hidden-states) returns only the post-norm final state, not the aux "
                "states EAGLE-3 trains on: use --sglang-mode plugin (eaglenest's capture plugin), or add "
                "--sglang-aux-url servers started with --enable-return-aux-hidden-states --speculative-algorithm EAGLE3 "
                "(see docs/sglang.md)")
        results: list[Captured | Failure | None] = [None] * len(batch)
        todo = []
        for i, r in enumerate(batch):
            if not r.input_ids:
                results[i] = Failure(r.id, "empty", "no tokens")
            elif min(r.input_ids) < 0 or max(r.input_ids) >= self.vocab_size:
                results[i] = Failure(r.id, "token_out_of_vocab", f"token id outside [0, {self.vocab_size})")
            else:
                todo.append(i)
        client = self._ensure("capture")
        self._check_servers()
        fn = self._capture_plugin if self.mode == "plugin" else self._capture_stock
        chunks = self._chunks(todo)
        for idx, outs in zip(chunks, client.map(lambda idx: fn([batch[i] for i in idx]), chunks)):
            for i, o in zip(idx, outs):
                results[i] = o
        return results  # type: ignore[return-value]

    def _capture_plugin(self, reqs: list[Request]) -> list[Captured | Failure]:
        res, rid_log = self._post_isolating(self.client, reqs, CAPTURE_RID_PREFIX, capture_sampling(), extra_key=True,
                                            hidden=False)
        try:
            out = []
            for r, x in zip(reqs, res):
                if isinstance(x, Failure):
                    out.append(x)
                    continue
                rid, item = x
                bad = check_item(item, rid, r.input_ids, r.id)
                if bad is None and (item.get("meta_info") or {}).get("cached_tokens"):
                    bad = Failure(r.id, "prefix_cached", f"the server reused {item['meta_info']['cached_tokens']} cached "
                                  "prompt tokens (its radix cache ignored extra_key?): launch with --disable-radix-cache")
                out.append(bad or self._collect(rid, r))
            return out
        finally:
            for rids in rid_log:
                for rid in rids:
                    self._remove_rid(rid)

    def _remove_rid(self, rid: str) -> None:
        for f in glob.glob(str(self.staging / f"{glob.escape(rid)}.*")):
            _remove(f)

    def _collect(self, rid: str, r: Request) -> Captured | Failure:
        """Wait for the plugin's files of `rid`, check them, assemble [T, n*H] (n = len(layer_ids)) and [T, H]."""
        import torch
        from safetensors import safe_open

        T = len(r.input_ids)
        deadline = time.time() + self.dump_timeout
        err = self.staging / plugin.error_name(rid)
        delay = 0.002
        while True:
            # the plugin writes every file atomically (temp file + rename): what is there is complete,
            # so a file that does not parse is damaged and fails the sample now
            if err.exists():
                try:
                    e = json.loads(err.read_text())
                except (OSError, json.JSONDecodeError) as x:
                    return Failure(r.id, "bad_staging_file", f"{err}: unreadable plugin error file ({x})")
                return Failure(r.id, str(e.get("reason") or "plugin_error"), f"capture plugin: {e.get('message')}")
            chunks = []
            for f in glob.glob(str(self.staging / f"{glob.escape(rid)}.*.safetensors")):
                try:
                    with safe_open(f, framework="pt", device="cpu") as h:
                        meta = h.metadata() or {}
                    chunks.append((int(meta["start"]), int(meta["n_tokens"]), f))
                except Exception as x:  # safetensors raises its own error types for a damaged header
                    return Failure(r.id, "bad_staging_file", f"{f}: {type(x).__name__}: {x}")
            chunks.sort()
            if chunks and chunks[0][0] > 0:
                return Failure(r.id, "prefix_cached", f"the first captured chunk starts at token {chunks[0][0]}: the server "
                               "reused a cached prefix (launch with --disable-radix-cache)")
            pos = 0
            for start, n, _ in chunks:
                if start != pos:
                    break
                pos += n
            if pos >= T and chunks:
                break
            if time.time() > deadline:
                if not chunks:
                    return Failure(r.id, "staging_missing",
                                   f"no capture file for rid {rid} in {self.staging} after {self.dump_timeout:.0f}s: is the "
                                   f"plugin loaded with {plugin.ENV_DIR}={self.staging}, on this machine, with prefill CUDA "
                                   "graphs off (--cuda-graph-backend-prefill disabled)?")
                return Failure(r.id, "staging_incomplete", f"capture files of rid {rid} cover tokens [0, {pos}) of {T}")
            time.sleep(delay)
            delay = min(0.05, delay * 2)
        parts = []
        for start, n, f in chunks:
            try:
                t, meta = plugin.read_dump(f)
            except Exception as e:
                return Failure(r.id, "bad_staging_file", f"{f}: {type(e).__name__}: {e}")
            if meta.get("rid") != rid:
                return Failure(r.id, "bad_staging_file", f"{f} is for rid {meta.get('rid')!r}")
            if meta.get("tp_rank", "0") != "0":  # only rank 0 may write: another writer is a plugin fault
                return Failure(r.id, "bad_staging_file", f"{f} was written by TP rank {meta['tp_rank']}")
            lids = json.loads(meta.get("layer_ids", "[]"))
            if lids != list(self.layer_ids):
                return Failure(r.id, "layer_mismatch", f"the plugin captured layers {lids}, this run wants {self.layer_ids}")
            want = r.input_ids[start:start + n]
            if (bad := check_echo(want, t["input_ids"], r.id)) is not None:
                bad.message = f"capture file (tokens {start}..{start + n}): " + bad.message
                return bad
            parts.append(t)
        ids = torch.cat([p["input_ids"] for p in parts])[:T]
        aux = torch.cat([p["aux_hidden_states"] for p in parts])[:T]
        last = torch.cat([p["last_hidden_state"] for p in parts])[:T]
        H, n = self.hidden_size, len(self.layer_ids)
        if tuple(aux.shape) != (T, n * H) or tuple(last.shape) != (T, H):
            return Failure(r.id, "bad_shape", f"captured aux {tuple(aux.shape)} / final {tuple(last.shape)}, expected "
                           f"{(T, n * H)} / {(T, H)}")
        return Captured(r.id, ids.to(torch.long), aux.contiguous(), last.contiguous())

    def _capture_stock(self, reqs: list[Request]) -> list[Captured | Failure]:
        import torch

        got = {}
        for name, client in (("final", self.client), ("aux", self.aux_client)):
            res, _ = self._post_isolating(client, reqs, STOCK_RID_PREFIX, capture_sampling(), extra_key=True, hidden=True)
            got[name] = res
        out = []
        H = self.hidden_size
        for k, r in enumerate(reqs):
            T = len(r.input_ids)
            tensors = {}
            fail = None
            for name, width in (("final", H), ("aux", len(self.layer_ids) * H)):
                x = got[name][k]
                if isinstance(x, Failure):
                    fail = x
                    break
                rid, item = x
                if (fail := check_item(item, rid, r.input_ids, r.id)) is not None:
                    break
                rows = hidden_rows(item)
                if rows is None:
                    fail = Failure(r.id, "no_hidden_states", f"{name} server returned no meta_info.hidden_states: was it "
                                   "started with --enable-return-hidden-states?")
                    break
                if rows.shape[0] < T or rows.shape[1] != width:
                    what = "the final state" if name == "final" else "the aux concat"
                    fail = Failure(r.id, "bad_shape", f"{name} server returned hidden_states {tuple(rows.shape)}, expected "
                                   f"{(T, width)} ({what}){' -- fewer rows: a cached prefix?' if rows.shape[0] < T else ''}")
                    break
                tensors[name] = rows[:T]
            if fail is not None:
                out.append(fail)
                continue
            # float32 holds the JSON floats exactly (the server sent bf16/fp16 values); the store casts
            out.append(Captured(r.id, torch.tensor(r.input_ids, dtype=torch.long), tensors["aux"], tensors["final"]))
        return out

    # -- generation (regenerate)
    def generate(self, batch: list[Request], max_new_tokens: int, temperature: float = 0.0, seed: int = 0):
        sampling = generate_sampling(max_new_tokens, temperature, seed, self.eos_ids)

        def run(reqs: list[Request]) -> list[Generated | Failure]:
            res, _ = self._post_isolating(self.client, reqs, GENERATE_RID_PREFIX, sampling, extra_key=False, hidden=False)
            out = []
            for r, x in zip(reqs, res):
                if isinstance(x, Failure):
                    out.append(x)
                    continue
                rid, item = x
                bad = check_item(item, rid, r.input_ids, r.id)
                out.append(bad or finish(r.id, r.input_ids, item, self.eos_ids))
            return out

        results: list = [None] * len(batch)
        todo = []
        for i, r in enumerate(batch):
            if not r.input_ids:
                results[i] = Failure(r.id, "empty", "no tokens")
            else:
                todo.append(i)
        client = self._ensure("generate")
        chunks = self._chunks(todo)
        for idx, outs in zip(chunks, client.map(lambda idx: run([batch[i] for i in idx]), chunks)):
            for i, o in zip(idx, outs):
                results[i] = o
        return results


def _shm() -> str | None:
    """/dev/shm where it exists (staging in shared memory), else the system temp dir."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass  # the plugin's own clean-up or a late writer got there first
    except OSError as e:  # left-over staging files fill shared memory: say so
        print(f"sglang: warning: cannot remove staged file {path}: {e}", file=sys.stderr)
