"""The vLLM engine: capture through vLLM's `extract_hidden_states` method, and generation.

vLLM runs in its own virtualenv (`.venv-vllm`, made by `scripts/setup_vllm.sh`); this module only
starts it as a subprocess and talks HTTP to it (httpx), so the main venv never imports vLLM.

Capture (vLLM 0.32, facts checked in its source -- see docs/vllm.md):
  * the server runs `--speculative-config {"method": "extract_hidden_states",
    "num_speculative_tokens": 1, "draft_model_config": {"hf_config":
    {"eagle_aux_hidden_state_layer_ids": [a, b, c, ..., N]}}}` -- the aux ids, any number (capture-before:
    vLLM's id k is `hidden_states + residual` entering layer k) plus N, the last layer's output
    *before* the final norm -- and the hidden-states KV connector (`vllm_connector.py`, our
    CPU-capable subclass of vLLM's `ExampleHiddenStatesConnector`), with chunked prefill and
    prefix caching off (else the dumps come back split or short);
  * one `/v1/completions` request per sample: `prompt` = the token ids, `max_tokens` 1,
    `return_token_ids` true.  The echoed `prompt_token_ids` must equal what was sent.  The response's
    `kv_transfer_params.hidden_states_path` names a safetensors file (`hidden_states [T, n+1, H]`,
    `token_ids [T]`) that a writer thread finishes while holding an exclusive flock on
    `<path>.lock`; we take a shared flock (blocks until the write is done; the lock file itself
    stays), load with safetensors, delete both files, and split into aux `[T, n*H]` and the
    pre-norm final state `[T, H]`.

Servers: `--vllm-serve` (the default when no `--vllm-url` is given) starts one on a free
127.0.0.1 port and stops it on close(); `--vllm-url URL` (repeatable) uses running servers, which
must have been started with the same flags (`server_command()` prints them) and must write their
staging files somewhere this process can read (same machine or a shared filesystem).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from eaglenest import EaglenestError
from eaglenest.capture.layers import parse_layer_ids
from eaglenest.engines.base import Captured, Engine, EngineInfo, Failure, Generated, Request, check_echo
from eaglenest.engines.http import Client, RequestFailed, merge_stats
from eaglenest.engines.server import ServerProcess
from eaglenest.engines.vllm_fixes import plugin_dist
from eaglenest.models.target import eos_token_ids, model_config

NAME = "vllm"
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VENV = REPO_ROOT / ".venv-vllm"
CONNECTOR = "CPUHiddenStatesConnector"
CONNECTOR_MODULE = "eaglenest.engines.vllm_connector"
DEFAULT_KVCACHE_GIB = "2"


# ----------------------------------------------------------------------------------------- CLI


def add_arguments(p) -> None:
    p.add_argument("--vllm-url", action="append", default=None, metavar="URL",
                   help="vllm engine: base URL of a running server (repeatable; requests are spread over them). "
                   "Without it a server is started (--vllm-serve)")
    p.add_argument("--vllm-serve", action="store_true",
                   help="vllm engine: start a server on 127.0.0.1 (the default when no --vllm-url is given) and stop it at the end")
    p.add_argument("--vllm-python", default=None, metavar="PY",
                   help="vllm engine: python of the vLLM virtualenv (default $EAGLENEST_VLLM_PYTHON or ./.venv-vllm/bin/python)")
    p.add_argument("--vllm-concurrency", type=int, default=8, metavar="N", help="vllm engine: requests in flight at once")
    p.add_argument("--vllm-timeout", type=float, default=600.0, metavar="S", help="vllm engine: seconds per request")
    p.add_argument("--vllm-retries", type=int, default=3, metavar="N",
                   help="vllm engine: retries (with backoff) after a timeout, 5xx or connection error")
    p.add_argument("--vllm-startup-timeout", type=float, default=600.0, metavar="S",
                   help="vllm engine: seconds to wait for a started server to become healthy")
    p.add_argument("--vllm-max-model-len", type=int, default=None, metavar="N",
                   help="vllm engine: context length of a started server (default: the target's, at most 8192)")
    p.add_argument("--vllm-staging-dir", default=None, metavar="DIR",
                   help="vllm engine: where a started server writes hidden-state files (default: a temp dir, removed at the end)")
    p.add_argument("--vllm-log", default=None, metavar="FILE", help="vllm engine: server log file (default: in the temp dir)")
    p.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                   help="vllm engine: extra argument for a started server, e.g. --vllm-arg=--max-num-seqs=16 (repeatable)")


def create(args) -> "VLLMEngine":
    urls = getattr(args, "vllm_url", None) or []
    if urls and getattr(args, "vllm_serve", False):
        raise EaglenestError("give either --vllm-url (use running servers) or --vllm-serve (start one), not both")
    return VLLMEngine(
        args.model,
        layers=getattr(args, "layers", "auto"),
        dtype=getattr(args, "dtype", "bf16"),
        urls=urls,
        python=getattr(args, "vllm_python", None),
        concurrency=getattr(args, "vllm_concurrency", 8),
        timeout=getattr(args, "vllm_timeout", 600.0),
        retries=getattr(args, "vllm_retries", 3),
        startup_timeout=getattr(args, "vllm_startup_timeout", 600.0),
        max_model_len=getattr(args, "vllm_max_model_len", None),
        staging_dir=getattr(args, "vllm_staging_dir", None),
        log_file=getattr(args, "vllm_log", None),
        extra_server_args=getattr(args, "vllm_arg", None) or [],
    )


# ------------------------------------------------------------------------------------- server


def find_vllm_python(explicit: str | None = None) -> Path:
    """The python of the vLLM virtualenv: --vllm-python, $EAGLENEST_VLLM_PYTHON, or ./.venv-vllm."""
    cand = explicit or os.environ.get("EAGLENEST_VLLM_PYTHON") or str(DEFAULT_VENV / "bin" / "python")
    p = Path(cand)
    if not p.exists():
        raise EaglenestError(
            f"vLLM python not found at {p}: run `bash scripts/setup_vllm.sh` (creates .venv-vllm) "
            "or pass --vllm-python / set EAGLENEST_VLLM_PYTHON"
        )
    return p


def extract_spec_config(layer_ids: list[int], num_layers: int) -> dict:
    """`--speculative-config` that makes vLLM dump the aux states plus the pre-norm final state."""
    return {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [*layer_ids, num_layers]}},
    }


def connector_config(staging_dir: str | Path) -> dict:
    return {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(staging_dir)},
    }


def server_command(
    python: str | Path,
    model_path: str | Path,
    *,
    port: int,
    dtype: str = "bf16",
    max_model_len: int | None = None,
    capture: tuple[list[int], int, str | Path] | None = None,
    speculative_config: dict | None = None,
    extra: list[str] | None = None,
) -> list[str]:
    """The server command line.  `capture=(layer_ids, num_layers, staging_dir)` adds hidden-state
    extraction; `speculative_config` serves a draft (eval)."""
    cmd = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_path),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}.get(dtype, dtype),
        "--enforce-eager",
        "--seed", "0",
    ]
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    if capture is not None:
        layer_ids, num_layers, staging = capture
        cmd += [
            "--speculative-config", json.dumps(extract_spec_config(layer_ids, num_layers)),
            "--kv-transfer-config", json.dumps(connector_config(staging)),
            "--no-enable-chunked-prefill",
            "--no-enable-prefix-caching",
        ]
    elif speculative_config is not None:
        cmd += ["--speculative-config", json.dumps(speculative_config)]
    cmd += list(extra or [])
    return cmd


def server_process(cmd_factory, *, workdir: Path, log_file=None, startup_timeout: float = 600.0) -> ServerProcess:
    """A vLLM server, not started: vLLM's environment, and our plugin on its path (vLLM 0.32's CPU
    rejection sampler corrupts temperature > 0 speculation; `vllm_fixes.py` repairs it)."""
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", DEFAULT_KVCACHE_GIB),
           "VLLM_NO_USAGE_STATS": os.environ.get("VLLM_NO_USAGE_STATS", "1")}
    server = ServerProcess("vllm", cmd_factory, workdir=workdir, log_file=log_file, startup_timeout=startup_timeout, env=env)
    plugin_dist(server.path_dir)
    return server


def start_server(cmd_factory, *, workdir: Path, log_file=None, startup_timeout: float = 600.0) -> ServerProcess:
    """A started vLLM server (vLLM-specific environment; the process handling is shared)."""
    return server_process(cmd_factory, workdir=workdir, log_file=log_file, startup_timeout=startup_timeout).start()


# --------------------------------------------------------------------------------------- HTTP


def model_card(client: Client, url: str) -> dict:
    """The first model a server lists (`/v1/models`)."""
    data = client.get_json("/v1/models", url).get("data") or []
    if not data:
        raise RequestFailed("bad_response", f"{url}/v1/models lists no model")
    return data[0]


def metrics(client: Client, url: str | None = None) -> dict[str, float]:
    return parse_prometheus(client.http.get((url or client.urls[0]) + "/metrics").raise_for_status().text)


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text -> {"name{labels}": value}, plus {"name": sum over its label sets}."""
    out: dict[str, float] = {}
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        try:
            key, val = line.rsplit(" ", 1)
            v = float(val)
        except ValueError:
            continue  # not a `name value` sample line: no metric to read from it
        out[key] = v
        if "{" in key:
            name = key.split("{", 1)[0]
            sums[name] = sums.get(name, 0.0) + v
    for name, v in sums.items():
        out.setdefault(name, v)
    return out


# ------------------------------------------------------------------------------- hidden states


def read_hidden_states(path: str, timeout: float = 120.0, settle: float = 1.0) -> dict:
    """Wait for the connector's writer (shared flock on `<path>.lock`), then load `path` (safetensors).
    A file that cannot be loaded once its writer is done fails at once (`bad_staging_file`)."""
    lock = path + ".lock"
    deadline = time.time() + timeout
    if os.path.exists(lock):
        with open(lock) as lf:
            while True:
                try:
                    fcntl.flock(lf, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.time() > deadline:
                        raise RequestFailed("timeout", f"{path}: writer still holds {lock} after {timeout:.0f}s")
                    time.sleep(0.005)
            try:
                return _load_staged(path)
            finally:
                fcntl.flock(lf, fcntl.LOCK_UN)
    # no lock file (server started with use_synchronization_lock=false): the writer is done once the
    # file loads, or once its size has not changed for `settle` seconds
    last_size, since = -1, time.time()
    while True:
        if os.path.exists(path):
            size = os.path.getsize(path)
            if size != last_size:
                last_size, since = size, time.time()
            try:
                return _load_staged(path)
            except RequestFailed:
                if time.time() - since >= settle:
                    raise
        elif time.time() > deadline:
            raise RequestFailed("staging_missing", f"{path} not found: is the server's shared_storage_path readable from here?")
        if time.time() > deadline:
            raise RequestFailed("bad_staging_file", f"{path}: still not a loadable safetensors file after {timeout:.0f}s")
        time.sleep(0.01)


def _load_staged(path: str) -> dict:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path, device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise RequestFailed("bad_staging_file", f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None


def remove_staging(path: str) -> None:
    for p in (path, path + ".lock"):
        try:
            os.remove(p)
        except FileNotFoundError:
            pass  # already gone (e.g. the connector wrote no lock file)
        except OSError as e:  # a staging file left behind fills the staging directory: say so
            print(f"vllm: warning: cannot remove staged file {p}: {e}", file=sys.stderr)


# ------------------------------------------------------------------------------------- engine


class VLLMEngine(Engine):
    name = NAME

    def __init__(self, model, *, layers="auto", dtype="bf16", urls=(), python=None, concurrency=8, timeout=600.0,
                 retries=3, startup_timeout=600.0, max_model_len=None, staging_dir=None, log_file=None,
                 extra_server_args=()):
        from eaglenest.models.target import resolve_model_path

        self.path = resolve_model_path(model)
        self.cfg = model_config(self.path)
        self.num_layers = int(self.cfg["num_hidden_layers"])
        self.hidden_size = int(self.cfg["hidden_size"])
        self.vocab_size = int(self.cfg["vocab_size"])
        self.layer_ids = parse_layer_ids(layers, self.num_layers)
        self.dtype = dtype
        self.eos_ids = eos_token_ids(self.path)
        self.urls = list(urls or [])
        self.python_arg = python
        self.concurrency = max(1, int(concurrency))
        self.timeout = float(timeout)
        self.retries = int(retries)
        self.startup_timeout = float(startup_timeout)
        self.max_model_len = max_model_len or min(int(self.cfg.get("max_position_embeddings") or 8192), 8192)
        self.extra_server_args = list(extra_server_args or [])
        self.log_file = log_file
        self._tmp = Path(tempfile.mkdtemp(prefix="eaglenest-vllm-"))
        self.staging_dir = Path(staging_dir) if staging_dir else self._tmp / "hidden_states"
        self.staging_dir.mkdir(parents=True, exist_ok=True)
        self.server: ServerProcess | None = None
        self.server_mode: str | None = None  # "capture" | "generate" for a server we started
        self.client: Client | None = None
        self._closed_stats: list[dict] = []  # request accounts of clients already closed
        self._models: dict[str, dict] = {}
        self.server_version: str | None = None
        if self.urls:
            self.client = self._new_client(self.urls)

    def _new_client(self, urls: list[str]) -> Client:
        return Client(urls, timeout=self.timeout, retries=self.retries, concurrency=self.concurrency)

    # -- servers
    def _ensure(self, mode: str) -> Client:
        if self.urls:
            assert self.client is not None
            return self.client
        if self.server is not None and self.server_mode == mode and self.server.alive():
            assert self.client is not None
            return self.client
        self._stop_server()
        python = find_vllm_python(self.python_arg)
        capture = (self.layer_ids, self.num_layers, self.staging_dir) if mode == "capture" else None
        self.server = start_server(
            lambda port: server_command(python, self.path, port=port, dtype=self.dtype, max_model_len=self.max_model_len,
                                        capture=capture, extra=self.extra_server_args),
            workdir=self._tmp, log_file=self.log_file, startup_timeout=self.startup_timeout,
        )
        self.server_mode = mode
        self.client = self._new_client([self.server.url])
        return self.client

    def start(self, mode: str = "capture") -> None:
        """Start (or check) the server for `mode` ("capture" | "generate") now instead of on first
        use, so that callers can time the work without the server start-up."""
        if mode not in ("capture", "generate"):
            raise ValueError(mode)
        self._ensure(mode)

    def _stop_server(self) -> None:
        if self.client is not None and not self.urls:
            self._close_client()
        if self.server is not None:
            self.server.stop()
            self.server = None
            self.server_mode = None

    def _close_client(self) -> None:
        self._closed_stats.append(self.client.stats())
        self.client.close()
        self.client = None

    def close(self) -> None:
        self._stop_server()
        if self.client is not None:
            self._close_client()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def request_stats(self) -> dict:
        return merge_stats(*self._closed_stats, *([self.client.stats()] if self.client is not None else []))

    def info(self) -> EngineInfo:
        # vLLM's id N is the last layer's output before the final norm
        return self._server_info("pre", None if self.urls else self.dtype, urls=self.urls or "started",
                                 extract_layer_ids=[*self.layer_ids, self.num_layers])

    def _model(self, client: Client) -> dict:
        url = client.urls[0]
        if url not in self._models:
            self._models[url] = model_card(client, url)
        return self._models[url]

    # -- capture
    def capture(self, batch: list[Request]) -> list[Captured | Failure]:
        client = self._ensure("capture")
        try:
            model = self._model(client)["id"]
        except RequestFailed as e:
            return [Failure(r.id, e.reason, e.message) for r in batch]
        return client.map(lambda r: self._capture_one(client, model, r), batch)

    def _capture_one(self, client: Client, model: str, r: Request) -> Captured | Failure:
        import torch

        if not r.input_ids:
            return Failure(r.id, "empty", "no tokens")
        if min(r.input_ids) < 0 or max(r.input_ids) >= self.vocab_size:
            return Failure(r.id, "token_out_of_vocab", f"token id outside [0, {self.vocab_size})")
        payload = {"model": model, "prompt": list(r.input_ids), "max_tokens": 1, "temperature": 0.0,
                   "return_token_ids": True}
        path = None
        try:
            resp = client.request("POST", "/v1/completions", payload, tag=r.id)
            self.server_version = self.server_version or resp.get("system_fingerprint")
            path = (resp.get("kv_transfer_params") or {}).get("hidden_states_path")
            choice = (resp.get("choices") or [{}])[0]
            echoed = choice.get("prompt_token_ids")
            if echoed is None:
                return Failure(r.id, "bad_response", "response has no prompt_token_ids (server too old for return_token_ids?)")
            if (bad := check_echo(r.input_ids, echoed, r.id)) is not None:
                return bad
            if not path:
                return Failure(r.id, "no_hidden_states",
                               "response has no kv_transfer_params.hidden_states_path: is the server running the "
                               "extract_hidden_states method with the hidden-states connector?")
            data = read_hidden_states(path, timeout=min(self.timeout, 300.0))
        except RequestFailed as e:
            return Failure(r.id, e.reason, e.message)
        finally:
            if path:
                remove_staging(path)
        hs, tok = data.get("hidden_states"), data.get("token_ids")
        if hs is None or tok is None:
            return Failure(r.id, "bad_staging_file", f"{path}: expected tensors hidden_states and token_ids, got {sorted(data)}")
        if (bad := check_echo(r.input_ids, tok, r.id)) is not None:
            bad.message = "hidden-state file: " + bad.message
            return bad
        T, L = len(r.input_ids), len(self.layer_ids) + 1
        if hs.dim() != 3 or tuple(hs.shape) != (T, L, self.hidden_size):
            return Failure(r.id, "bad_shape", f"hidden_states {tuple(hs.shape)} != {(T, L, self.hidden_size)}: "
                           f"was the server started with layer ids {[*self.layer_ids, self.num_layers]}?")
        aux = hs[:, : L - 1].reshape(T, (L - 1) * self.hidden_size)  # [T, n*H]: layers in order, like torch.cat
        last = hs[:, L - 1].contiguous()  # [T, H], pre-norm
        return Captured(r.id, torch.tensor(tok.tolist(), dtype=torch.long), aux.contiguous(), last)

    # -- generation
    def generate(self, batch: list[Request], max_new_tokens: int, temperature: float = 0.0, seed: int = 0):
        client = self._ensure("generate")
        try:
            model = self._model(client)
        except RequestFailed as e:
            return [Failure(r.id, e.reason, e.message) for r in batch]
        max_len = int(model.get("max_model_len") or self.max_model_len)
        return client.map(lambda r: self._generate_one(client, model["id"], max_len, r, max_new_tokens, temperature, seed), batch)

    def _generate_one(self, client, model, max_len, r: Request, max_new_tokens, temperature, seed) -> Generated | Failure:
        budget = min(max_new_tokens, max_len - len(r.input_ids))
        if budget < 1:
            return Failure(r.id, "too_long", f"prompt of {len(r.input_ids)} tokens leaves no room in max_model_len {max_len}")
        payload = {
            "model": model,
            "prompt": list(r.input_ids),
            "max_tokens": budget,
            "temperature": float(temperature),
            "top_p": 1.0,
            "top_k": 0,
            "seed": int(seed),
            "return_token_ids": True,
            "skip_special_tokens": False,
            "stop_token_ids": list(self.eos_ids),
        }
        try:
            resp = client.request("POST", "/v1/completions", payload, tag=r.id)
        except RequestFailed as e:
            return Failure(r.id, e.reason, e.message)
        choice = (resp.get("choices") or [{}])[0]
        echoed = choice.get("prompt_token_ids")
        if echoed is None:
            return Failure(r.id, "bad_response", "response has no prompt_token_ids")
        if (bad := check_echo(r.input_ids, echoed, r.id)) is not None:
            return bad
        out = list(choice.get("token_ids") or [])
        return finish_generated(r.id, echoed, out, choice.get("finish_reason"), choice.get("stop_reason"), self.eos_ids)


def finish_generated(sid, prompt_ids, out, finish_reason, stop_reason, eos_ids) -> Generated:
    """Normalize a completion: a turn that ended on a stop/eos token always ends with that token."""
    if finish_reason == "stop":
        stop_tok = stop_reason if isinstance(stop_reason, int) else None
        if not out or out[-1] not in eos_ids:
            tok = stop_tok if stop_tok is not None else (eos_ids[0] if eos_ids else None)
            if tok is not None and (not out or out[-1] != tok):
                out.append(tok)
        return Generated(sid, list(prompt_ids), out, "stop")
    return Generated(sid, list(prompt_ids), out, "length")
