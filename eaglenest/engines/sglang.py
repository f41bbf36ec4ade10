"""The SGLang engine: a client of SGLang's native `POST /generate` (targets SGLang 0.5.23).

Servers: `--sglang-url URL` (repeatable) uses running servers, anywhere; `--sglang-serve` starts one
on this machine's CPU (SGLang's CPU engine on its torch-native path, from `.venv-sglang`, made by
`scripts/setup_sglang.sh`; see `sglang_launch.py`) on a free 127.0.0.1 port, with eaglenest's capture
plugin on its path for capture, and stops it at the end (logs kept with `--sglang-log`).  Facts below
were read in SGLang 0.5.23's published source and checked against a live 0.5.23 server (docs/sglang.md).

Requests (`GenerateReqInput`, sglang/srt/managers/io_struct.py): always the batch form --
`input_ids` as a list of lists, `rid` and `extra_key` as lists of unique strings (a unique
`extra_key` isolates each sample's radix-cache namespace, so every prompt is fully prefilled),
`sampling_params` one dict, `return_prompt_token_ids: true` (the response then echoes the prompt ids
under the top-level `prompt_token_ids`), and `return_hidden_states: true` where the mode uses it.
`prompt_token_ids` is never sent: it is a response field only.  Every response is checked:
`meta_info.id` must be the rid sent, `meta_info.prompt_tokens` must equal the number of ids sent and
the echoed `prompt_token_ids` must equal them (else the sample fails with `token_mismatch`).

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
    three aux states: capture in this mode needs `--sglang-aux-url` servers started with
    `--enable-return-aux-hidden-states --speculative-algorithm EAGLE3
    --return-aux-hidden-state-layer-ids` (0.5.23), whose `hidden_states` are the aux concat
    [T, 3H] instead; each sample then costs one request to each kind of server.  Without aux
    servers, capture stops with an error saying so.  Generation (regenerate) works in both modes.

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
from eaglenest.engines import sglang_plugin as plugin
from eaglenest.engines.base import Captured, Engine, EngineInfo, Failure, Generated, Request, check_echo
from eaglenest.engines.http import Client, RequestFailed, merge_stats
from eaglenest.engines.server import ServerProcess
from eaglenest.models.target import eos_token_ids, model_config

NAME = "sglang"
TARGET_SGLANG_VERSION = plugin.TARGET_SGLANG_VERSION
MODES = ("plugin", "stock")
CAPTURE_RID_PREFIX = plugin.DEFAULT_RID_PREFIX  # the plugin only observes rids with this prefix
GENERATE_RID_PREFIX = "eaglenest-gen-"
CAPTURE_MAX_NEW_TOKENS = 1  # 0 also prefills on 0.5.23 (Req.is_prefill_only), 1 works on every version

# the GenerateReqInput fields this client sends (all present in SGLang 0.5.23)
REQUEST_FIELDS = ("input_ids", "sampling_params", "rid", "extra_key", "return_hidden_states", "return_prompt_token_ids")
SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_p", "stop_token_ids", "skip_special_tokens", "sampling_seed")

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VENV = REPO_ROOT / ".venv-sglang"
COMPAT_DIR = Path(__file__).resolve().parent / "sglang_compat"  # holds eaglenest's sgl_kernel
LAUNCHER = "eaglenest.engines.sglang_launch"
DEFAULT_MAX_TOTAL_TOKENS = 32768  # KV-cache tokens of a started server (SGLang would take ~70% of the RAM)


# ----------------------------------------------------------------------------------------- CLI


def add_arguments(p) -> None:
    p.add_argument("--sglang-url", action="append", default=None, metavar="URL",
                   help="sglang engine: base URL of a running SGLang server (repeatable; requests are spread over them)")
    p.add_argument("--sglang-serve", action="store_true",
                   help="sglang engine: start SGLang's CPU engine (torch-native path, from .venv-sglang) on a free "
                   "127.0.0.1 port, with the capture plugin on its path, and stop it at the end")
    p.add_argument("--sglang-mode", choices=MODES, default="plugin",
                   help="sglang engine: 'plugin' = the server runs eaglenest's capture plugin (full EAGLE-3 features); "
                   "'stock' = unmodified servers (--enable-return-hidden-states: final state only; capture also needs "
                   "--sglang-aux-url)")
    p.add_argument("--sglang-aux-url", action="append", default=None, metavar="URL",
                   help="sglang engine, stock mode: servers started with --enable-return-aux-hidden-states "
                   "--speculative-algorithm EAGLE3 (they return the aux concat instead of the final state)")
    p.add_argument("--sglang-staging", default=None, metavar="DIR",
                   help="sglang engine, plugin mode: the plugin's staging directory (the server's "
                   f"EAGLENEST_SGLANG_CAPTURE_DIR; must be readable from here; default {plugin.DEFAULT_DIR}, or a "
                   "fresh directory under /dev/shm for --sglang-serve)")
    p.add_argument("--sglang-concurrency", type=int, default=4, metavar="N", help="sglang engine: requests in flight at once")
    p.add_argument("--sglang-batch", type=int, default=8, metavar="N", help="sglang engine: samples per /generate request")
    p.add_argument("--sglang-timeout", type=float, default=600.0, metavar="S", help="sglang engine: seconds per request")
    p.add_argument("--sglang-retries", type=int, default=3, metavar="N",
                   help="sglang engine: retries (exponential backoff and jitter) after a timeout, 5xx or connection error")
    p.add_argument("--sglang-dump-timeout", type=float, default=60.0, metavar="S",
                   help="sglang engine, plugin mode: seconds to wait for a request's staging files after its response")
    p.add_argument("--sglang-skip-preflight", action="store_true",
                   help="sglang engine: do not check /server_info (version, prefill CUDA graph, ...) before capturing")
    p.add_argument("--sglang-python", default=None, metavar="PY",
                   help="sglang engine, --sglang-serve: python of the SGLang virtualenv (default $EAGLENEST_SGLANG_PYTHON "
                   "or ./.venv-sglang/bin/python)")
    p.add_argument("--sglang-startup-timeout", type=float, default=600.0, metavar="S",
                   help="sglang engine, --sglang-serve: seconds to wait for the server to become healthy")
    p.add_argument("--sglang-log", default=None, metavar="FILE",
                   help="sglang engine, --sglang-serve: server log file (default: in a temp dir, removed at the end)")
    p.add_argument("--sglang-arg", action="append", default=[], metavar="ARG",
                   help="sglang engine, --sglang-serve: extra server argument, e.g. --sglang-arg=--max-total-tokens=65536 "
                   "(repeatable)")


def check_server_choice(urls, serve: bool, needs: str) -> None:
    """Exactly one of: running servers (URLs) or --sglang-serve.  `needs` opens the error for neither."""
    if urls and serve:
        raise EaglenestError("give either --sglang-url (running servers) or --sglang-serve (start one), not both")
    if not urls and not serve:
        raise EaglenestError(f"{needs} or --sglang-serve (start SGLang's CPU engine here)")


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


# ------------------------------------------------------------------------------------- server


def refuse_cpu_mla(cfg: dict, path) -> None:
    """--sglang-serve starts SGLang's CPU engine (torch-native attention), whose MLA prefill attends
    over the compressed latent KV pool instead of the per-head k/v it is given (0.5.23,
    torch_native_backend.py forward_extend; docs/sglang.md): DeepSeek-V2/V3/Kimi states and tokens
    come out wrong (or the first prefill fails on real shapes).  Refused, not warned about."""
    from eaglenest.models.target import target_facts

    fam = target_facts(cfg).family
    if fam.attention == "mla":
        raise EaglenestError(
            f"{path}: a {fam.name} target (MLA attention) cannot be served correctly by SGLang 0.5.23's CPU engine "
            "(its torch-native MLA prefill attends over the latent KV cache, not the per-head keys and values; see "
            "docs/sglang.md): serve it on GPUs and pass --sglang-url, or use --engine hf / vllm")


def find_sglang_python(explicit: str | None = None) -> Path:
    """The python of the SGLang virtualenv: --sglang-python, $EAGLENEST_SGLANG_PYTHON, or ./.venv-sglang."""
    p = Path(explicit or os.environ.get("EAGLENEST_SGLANG_PYTHON") or DEFAULT_VENV / "bin" / "python")
    if not p.exists():
        raise EaglenestError(f"SGLang python not found at {p}: run `bash scripts/setup_sglang.sh` (creates .venv-sglang) "
                             "or pass --sglang-python / set EAGLENEST_SGLANG_PYTHON")
    return p


def cpu_server_pythonpath() -> list[Path]:
    """What a CPU server started by eaglenest has on its path besides `eaglenest`: the sgl_kernel
    compatibility module (and, for `sglang-plugin check --cpu`, eaglenest itself)."""
    return [REPO_ROOT, COMPAT_DIR]


def server_command(python, model_path, *, port: int, dtype: str = "bf16", mode: str = "generate",
                   max_total_tokens: int = DEFAULT_MAX_TOTAL_TOKENS, speculative: dict | None = None,
                   extra: list[str] | None = None) -> list[str]:
    """The command line of a CPU server (SGLang 0.5.23 flags, through eaglenest's launcher).
    mode: "plugin" (capture through the plugin: no radix cache), "stock" (final states as JSON),
    "generate"; `speculative` = {"draft": DIR, "steps": S, "topk": K, "draft_tokens": D} serves a draft."""
    cmd = [str(python), "-m", LAUNCHER, "--model-path", str(model_path), "--host", "127.0.0.1", "--port", str(port),
           "--device", "cpu", "--attention-backend", "torch_native",
           "--dtype", {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}.get(dtype, dtype),
           "--disable-overlap-schedule", "--sleep-on-idle", "--random-seed", "0",
           "--max-total-tokens", str(max_total_tokens), "--cuda-graph-backend-prefill", "disabled"]
    if mode == "plugin":
        cmd += ["--disable-radix-cache"]
    elif mode == "stock":
        cmd += ["--enable-return-hidden-states", "--disable-radix-cache"]
    elif mode != "generate":
        raise ValueError(mode)
    if speculative:
        cmd += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(speculative["draft"]),
                "--speculative-num-steps", str(speculative["steps"]), "--speculative-eagle-topk", str(speculative["topk"]),
                "--speculative-num-draft-tokens", str(speculative["draft_tokens"])]
    return cmd + list(extra or [])


def start_server(cmd_factory, *, workdir: Path, log_file=None, startup_timeout: float = 600.0,
                 capture_dir: Path | None = None, layer_ids: list[int] | None = None) -> ServerProcess:
    """A started CPU server.  With `capture_dir`, eaglenest's capture plugin is on the server's path
    (installed into the directory that holds `eaglenest`, where SGLang's `load_plugins()` finds its
    entry point) and active, writing there."""
    from eaglenest.engines.sglang_plugin_cli import install_into

    env = {"SGLANG_USE_CPU_ENGINE": "1"}
    if capture_dir is not None:
        env[plugin.ENV_DIR] = str(capture_dir)
        if layer_ids is not None:
            env[plugin.ENV_LAYERS] = ",".join(map(str, layer_ids))
    srv = ServerProcess("sglang", cmd_factory, workdir=workdir, log_file=log_file, startup_timeout=startup_timeout,
                        env=env, pythonpath=[COMPAT_DIR])
    if capture_dir is not None:
        install_into(srv.path_dir)
    return srv.start()


# --------------------------------------------------------------------------- layer-id rules

# `set_eagle3_layers_to_capture(layer_ids)` in SGLang 0.5.23 turns the ids of a draft's
# `eagle_config.eagle_aux_hidden_state_layer_ids` (or --return-aux-hidden-state-layer-ids) into the
# layers it captures before (`layers_to_capture`), per model class:
#   Llama family (models/llama.py), Qwen2, Qwen3, Qwen3-MoE: every id + 1;
#   DeepseekV2/V3/V3.2 (models/deepseek_v2.py; Kimi-K2 serves as DeepseekV3ForCausalLM):
#     + 1 only when the first id is 1, else the ids as given.
# Checked live on SGLang 0.5.23 for Llama and DeepseekV3 (tests/test_sglang_live_deepseek.py).
_PLUS_ONE = {"llama", "qwen2", "qwen3", "qwen3_moe"}


def sglang_capture_layers(architecture: str, ids: list[int]) -> list[int]:
    """Capture-before ids SGLang 0.5.23 captures for a draft whose eagle_config lists `ids`."""
    spec = plugin.ARCHITECTURES.get(architecture)
    if spec is None:
        raise EaglenestError(f"no SGLang layer rule known for {architecture} (known: {', '.join(sorted(plugin.ARCHITECTURES))})")
    if spec.name in _PLUS_ONE or (spec.name == "deepseek_v2" and ids and ids[0] == 1):
        return [k + 1 for k in ids]
    return list(ids)


def sglang_layer_ids_for(architecture: str, capture_before: list[int]) -> list[int] | None:
    """The eagle_config ids that make SGLang 0.5.23 capture exactly `capture_before`, or None when
    no ids do (DeepseekV2 family with a first layer of 1)."""
    for ids in ([k - 1 for k in capture_before], list(capture_before)):
        if min(ids) >= 0 and sglang_capture_layers(architecture, ids) == list(capture_before):
            return ids
    return None


# ----------------------------------------------------------------------------------- payloads


def generate_payload(ids: list[list[int]], rids: list[str], sampling: dict, *, extra_keys: list[str] | None = None,
                     return_hidden_states: bool = False) -> dict:
    """A batched `/generate` body (field names exactly as in GenerateReqInput, SGLang 0.5.23)."""
    if not ids or len(ids) != len(rids) or len(set(rids)) != len(rids):
        raise ValueError("one unique rid per sample")
    body = {"input_ids": [list(map(int, x)) for x in ids], "rid": list(rids), "sampling_params": dict(sampling),
            "return_prompt_token_ids": True}
    if extra_keys is not None:
        if len(extra_keys) != len(ids):
            raise ValueError("one extra_key per sample")
        body["extra_key"] = list(extra_keys)
    if return_hidden_states:
        body["return_hidden_states"] = True
    return body


def capture_sampling() -> dict:
    return {"max_new_tokens": CAPTURE_MAX_NEW_TOKENS, "temperature": 0.0}


def generate_sampling(max_new_tokens: int, temperature: float, seed: int, stop_ids: list[int]) -> dict:
    s = {"max_new_tokens": int(max_new_tokens), "temperature": float(temperature), "top_p": 1.0,
         "skip_special_tokens": False}
    if stop_ids:
        s["stop_token_ids"] = [int(t) for t in stop_ids]
    if temperature > 0:
        s["sampling_seed"] = int(seed)
    return s


def response_items(resp, n: int) -> list[dict]:
    """The per-sample outputs of a batched /generate (a list, in request order)."""
    if isinstance(resp, dict):
        resp = [resp]
    if not isinstance(resp, list) or len(resp) != n or not all(isinstance(x, dict) for x in resp):
        raise RequestFailed("bad_response", f"expected a list of {n} outputs, got {type(resp).__name__}"
                            f"{f' of {len(resp)}' if isinstance(resp, list) else ''}")
    return resp


def check_item(item: dict, rid: str, sent: list[int], sid: str) -> Failure | None:
    """The server must report this rid and exactly the prompt that was sent."""
    meta = item.get("meta_info") or {}
    if meta.get("id") not in (None, rid):
        return Failure(sid, "bad_response", f"response is for request {meta.get('id')!r}, expected {rid!r}")
    fr = meta.get("finish_reason")
    if isinstance(fr, dict) and fr.get("type") == "abort":
        return Failure(sid, "aborted", f"server aborted the request: {fr.get('message')}")
    pt = meta.get("prompt_tokens")
    if pt is None:
        return Failure(sid, "bad_response", "meta_info has no prompt_tokens")
    if int(pt) != len(sent):
        return Failure(sid, "token_mismatch", f"server reports {pt} prompt tokens, {len(sent)} were sent")
    echoed = item.get("prompt_token_ids")
    if echoed is not None and (bad := check_echo(sent, echoed, sid)) is not None:
        return bad
    return None


def hidden_rows(item: dict):
    """`meta_info.hidden_states` of a stock server -> float32 tensor [rows, width].  0.5.23 appends
    one 2-D block [n, H] per prefill chunk, then one row per generated token."""
    import torch

    hs = (item.get("meta_info") or {}).get("hidden_states")
    if not hs:
        return None
    blocks = []
    for el in hs:
        if el and isinstance(el[0], (list, tuple)):
            blocks.append(torch.tensor(el, dtype=torch.float32))
    return torch.cat(blocks, 0) if blocks else None


def finish(sid: str, prompt: list[int], item: dict, eos_ids: list[int]) -> Generated | Failure:
    out = [int(t) for t in (item.get("output_ids") or [])]
    fr = (item.get("meta_info") or {}).get("finish_reason")
    kind = fr.get("type") if isinstance(fr, dict) else fr
    if kind == "abort":
        return Failure(sid, "aborted", f"server aborted the request: {fr.get('message') if isinstance(fr, dict) else fr}")
    if kind == "stop":
        matched = fr.get("matched") if isinstance(fr, dict) else None
        tok = matched if isinstance(matched, int) else (eos_ids[0] if eos_ids else None)
        if tok is not None and (not out or out[-1] not in set(eos_ids) | {tok}):
            out.append(tok)  # a turn ended by a stop token always ends with it
        return Generated(sid, list(prompt), out, "stop")
    return Generated(sid, list(prompt), out, "length")


def find_key(obj, key: str):
    """First value of `key` anywhere in nested dicts (/server_info nests some records)."""
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        for v in obj.values():
            r = find_key(v, key)
            if r is not None:
                return r
    return None


def preflight_problems(info: dict, mode: str) -> tuple[list[str], list[str]]:
    """(errors, warnings) about a server's /server_info for capture in `mode`."""
    errors, warnings = [], []
    version = info.get("version")
    if version != TARGET_SGLANG_VERSION:
        warnings.append(f"server runs SGLang {version}, eaglenest targets {TARGET_SGLANG_VERSION}")
    if (find_key(info, "pp_size") or 1) > 1:
        errors.append("pp_size > 1: capture needs pipeline parallelism off")
    if find_key(info, "enable_dp_attention"):
        errors.append("DP attention is on: the plugin writes from TP rank 0 only")
    if mode == "plugin":
        cg = find_key(info, "cuda_graph_config")
        backend = (cg or {}).get("prefill", {}).get("backend") if isinstance(cg, dict) else find_key(info, "cuda_graph_backend_prefill")
        if backend not in (None, "disabled"):
            errors.append(f"prefill CUDA graph backend is {backend!r}: a replayed graph runs no Python hooks; "
                          "launch with --cuda-graph-backend-prefill disabled")
        if find_key(info, "enable_two_batch_overlap"):
            warnings.append("two-batch overlap is on: DeepseekV2 aux layers under TBO cannot be observed (those samples fail)")
    else:
        if not (find_key(info, "enable_return_hidden_states") or find_key(info, "return_hidden_states_mode") == "full"):
            errors.append("the server was not started with --enable-return-hidden-states")
    return errors, warnings


# ------------------------------------------------------------------------------------- engine


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
        return self._server_info("post", urls=self.urls or "started", mode=self.mode,
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
                "stock SGLang (--enable-return-hidden-states) returns only the post-norm final state, not the three aux "
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
        """Wait for the plugin's files of `rid`, check them, assemble [T, 3H] and [T, H]."""
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
        H = self.hidden_size
        if tuple(aux.shape) != (T, 3 * H) or tuple(last.shape) != (T, H):
            return Failure(r.id, "bad_shape", f"captured aux {tuple(aux.shape)} / final {tuple(last.shape)}, expected "
                           f"{(T, 3 * H)} / {(T, H)}")
        return Captured(r.id, ids.to(torch.long), aux.contiguous(), last.contiguous())

    def _capture_stock(self, reqs: list[Request]) -> list[Captured | Failure]:
        import torch

        got = {}
        for name, client in (("final", self.client), ("aux", self.aux_client)):
            res, _ = self._post_isolating(client, reqs, CAPTURE_RID_PREFIX, capture_sampling(), extra_key=True, hidden=True)
            got[name] = res
        out = []
        H = self.hidden_size
        for k, r in enumerate(reqs):
            T = len(r.input_ids)
            tensors = {}
            fail = None
            for name, width in (("final", H), ("aux", 3 * H)):
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
