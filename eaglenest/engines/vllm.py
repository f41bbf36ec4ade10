"""The vLLM engine: capture through vLLM's `extract_hidden_states` method, and generation.

vLLM runs in its own virtualenv (`.venv-vllm`, made by `scripts/setup_vllm.sh`); this module only
starts it as a subprocess and talks HTTP to it (httpx), so the main venv never imports vLLM.

Capture (vLLM 0.32, facts checked in its source -- see docs/vllm.md):
  * the server runs `--speculative-config {"method": "extract_hidden_states",
    "num_speculative_tokens": 1, "draft_model_config": {"hf_config":
    {"eagle_aux_hidden_state_layer_ids": [a, b, c, N]}}}` -- the three aux ids (capture-before:
    vLLM's id k is `hidden_states + residual` entering layer k) plus N, the last layer's output
    *before* the final norm -- and the hidden-states KV connector (`vllm_connector.py`, our
    CPU-capable subclass of vLLM's `ExampleHiddenStatesConnector`), with chunked prefill and
    prefix caching off (else the dumps come back split or short);
  * one `/v1/completions` request per sample: `prompt` = the token ids, `max_tokens` 1,
    `return_token_ids` true.  The echoed `prompt_token_ids` must equal what was sent.  The response's
    `kv_transfer_params.hidden_states_path` names a safetensors file (`hidden_states [T, 4, H]`,
    `token_ids [T]`) that a writer thread finishes while holding an exclusive flock on
    `<path>.lock`; we take a shared flock (blocks until the write is done; the lock file itself
    stays), load with safetensors, delete both files, and split into aux `[T, 3H]` and the
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
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from eaglenest import EaglenestError
from eaglenest.capture.layers import parse_layer_ids
from eaglenest.engines.base import Captured, Engine, EngineInfo, Failure, Generated, Request, check_echo
from eaglenest.models.target import eos_token_ids, model_config

NAME = "vllm"
REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIR = Path(__file__).resolve().parents[1]  # .../eaglenest
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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM it when the process that started it dies, so a
    killed eaglenest never leaves a server behind (vLLM's API server then stops its engine)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


class VLLMServer:
    """One `python -m vllm.entrypoints.openai.api_server` subprocess on 127.0.0.1 (own process group)."""

    def __init__(self, cmd_factory, *, workdir: Path, log_file: str | Path | None = None,
                 startup_timeout: float = 600.0, env: dict | None = None):
        self.cmd_factory = cmd_factory  # port -> argv
        self.port = free_port()
        self.cmd = cmd_factory(self.port)
        self.workdir = Path(workdir)
        self.log_path = Path(log_file) if log_file else self.workdir / "server.log"
        self.startup_timeout = startup_timeout
        self.extra_env = env or {}
        self.proc: subprocess.Popen | None = None
        self.url = f"http://127.0.0.1:{self.port}"
        self.start_seconds: float | None = None

    def _env(self) -> dict:
        # only eaglenest goes on the server's path (a symlink farm): never the main venv's site-packages
        pkgs = self.workdir / "pythonpath"
        pkgs.mkdir(parents=True, exist_ok=True)
        link = pkgs / "eaglenest"
        if not link.exists():
            link.symlink_to(PACKAGE_DIR, target_is_directory=True)
        env = dict(os.environ)
        for k in ("PYTHONHOME", "VIRTUAL_ENV"):
            env.pop(k, None)
        env["PYTHONPATH"] = str(pkgs)  # not inherited: it could point into the main venv
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", DEFAULT_KVCACHE_GIB)
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("DO_NOT_TRACK", "1")
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.update(self.extra_env)
        return env

    def start(self) -> "VLLMServer":
        try:
            for attempt in range(2):
                if self._start_once():
                    return self
                # the free port was taken between our probe and the server's bind: once more
                self.port = free_port()
                self.cmd = self.cmd_factory(self.port)
                self.url = f"http://127.0.0.1:{self.port}"
            raise EaglenestError(f"vLLM server could not bind a port; last lines of {self.log_path}:\n{self.log_tail()}")
        except BaseException:
            self.stop()  # also on Ctrl-C while waiting: never leave a server behind
            raise

    def _start_once(self) -> bool:
        import httpx

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        print(f"vllm: starting server on {self.url} (log: {self.log_path})", file=sys.stderr)
        t0 = time.time()
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=self._env(), start_new_session=True, preexec_fn=_die_with_parent)
        log.close()
        deadline = t0 + self.startup_timeout
        with httpx.Client(timeout=5.0) as c:
            while True:
                rc = self.proc.poll()
                if rc is not None:
                    self.stop()
                    tail = self.log_tail()
                    if "address already in use" in tail.lower():
                        return False
                    raise EaglenestError(f"vLLM server exited with code {rc} while starting; last lines of {self.log_path}:\n{tail}")
                try:
                    if c.get(self.url + "/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.time() > deadline:
                    tail = self.log_tail()
                    self.stop()
                    raise EaglenestError(f"vLLM server not healthy after {self.startup_timeout:.0f}s; last lines of {self.log_path}:\n{tail}")
                time.sleep(0.5)
        self.start_seconds = time.time() - t0
        print(f"vllm: server ready in {self.start_seconds:.1f}s", file=sys.stderr)
        return True

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        # the engine-config line is one huge line: shorten long lines
        return "\n".join(ln if len(ln) < 600 else ln[:600] + " ..." for ln in lines[-n:])

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace: float = 30.0) -> None:
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)  # our own process group (start_new_session)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=10)
        # API server gone: make sure no engine-core child of our group outlives it
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


# --------------------------------------------------------------------------------------- HTTP


class RequestFailed(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


class Client:
    """httpx with retries (exponential backoff + jitter) on timeouts, 5xx and connection errors."""

    def __init__(self, urls: list[str], *, timeout: float, retries: int, concurrency: int):
        import httpx

        self.urls = [u.rstrip("/") for u in urls]
        self.retries = max(0, retries)
        self.http = httpx.Client(timeout=httpx.Timeout(timeout, connect=10.0),
                                 limits=httpx.Limits(max_connections=max(4, concurrency * 2)))
        self._rr = 0
        self._lock = threading.Lock()
        self._models: dict[str, dict] = {}

    def close(self) -> None:
        self.http.close()

    def _next_url(self) -> str:
        with self._lock:
            u = self.urls[self._rr % len(self.urls)]
            self._rr += 1
            return u

    def model_card(self, url: str) -> dict:
        if url not in self._models:
            r = self.request("GET", "/v1/models", url=url)
            data = r.get("data") or []
            if not data:
                raise RequestFailed("bad_response", f"{url}/v1/models lists no model")
            self._models[url] = data[0]
        return self._models[url]

    def request(self, method: str, path: str, payload: dict | None = None, url: str | None = None) -> dict:
        import httpx

        last = RequestFailed("unknown", "no attempt made")
        for attempt in range(self.retries + 1):
            base = url or self._next_url()
            try:
                r = self.http.request(method, base + path, json=payload)
                if r.status_code >= 500:
                    last = RequestFailed("http_5xx", f"{base}{path}: HTTP {r.status_code}: {r.text[:300]}")
                elif r.status_code >= 400:
                    text = r.text[:500]
                    reason = "too_long" if "context length" in text or "max_model_len" in text or "maximum" in text.lower() else f"http_{r.status_code}"
                    raise RequestFailed(reason, f"{base}{path}: HTTP {r.status_code}: {text}")
                else:
                    try:
                        return r.json()
                    except json.JSONDecodeError:
                        raise RequestFailed("bad_response", f"{base}{path}: response is not JSON: {r.text[:200]}") from None
            except httpx.TimeoutException as e:
                last = RequestFailed("timeout", f"{base}{path}: timed out ({type(e).__name__})")
            except (httpx.TransportError,) as e:
                last = RequestFailed("connection", f"{base}{path}: {type(e).__name__}: {e}")
            if attempt < self.retries:
                time.sleep(min(8.0, 0.5 * 2**attempt) * (0.5 + random.random()))
        last.message += f" (after {self.retries + 1} attempts)"
        raise last

    def metrics(self, url: str | None = None) -> dict[str, float]:
        r = self.http.get((url or self.urls[0]) + "/metrics")
        r.raise_for_status()
        return parse_prometheus(r.text)


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
            continue
        out[key] = v
        if "{" in key:
            name = key.split("{", 1)[0]
            sums[name] = sums.get(name, 0.0) + v
    for name, v in sums.items():
        out.setdefault(name, v)
    return out


# ------------------------------------------------------------------------------- hidden states


def read_hidden_states(path: str, timeout: float = 120.0) -> dict:
    """Wait for the connector's writer (shared flock on `<path>.lock`), then load `path` (safetensors)."""
    from safetensors.torch import load_file

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
                return load_file(path, device="cpu")
            finally:
                fcntl.flock(lf, fcntl.LOCK_UN)
    # no lock file (server started with use_synchronization_lock=false): wait for a loadable file
    while True:
        if os.path.exists(path):
            try:
                return load_file(path, device="cpu")
            except Exception:
                pass
        if time.time() > deadline:
            if not os.path.exists(path):
                raise RequestFailed("staging_missing", f"{path} not found: is the server's shared_storage_path readable from here?")
            raise RequestFailed("bad_staging_file", f"{path}: not a readable safetensors file")
        time.sleep(0.01)


def remove_staging(path: str) -> None:
    for p in (path, path + ".lock"):
        try:
            os.remove(p)
        except FileNotFoundError:
            pass
        except OSError:
            pass


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
        self.server: VLLMServer | None = None
        self.server_mode: str | None = None  # "capture" | "generate" for a server we started
        self.client: Client | None = None
        self.server_version: str | None = None
        if self.urls:
            self.client = Client(self.urls, timeout=self.timeout, retries=self.retries, concurrency=self.concurrency)

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
        self.server = VLLMServer(
            lambda port: server_command(python, self.path, port=port, dtype=self.dtype, max_model_len=self.max_model_len,
                                        capture=capture, extra=self.extra_server_args),
            workdir=self._tmp, log_file=self.log_file, startup_timeout=self.startup_timeout,
        ).start()
        self.server_mode = mode
        self.client = Client([self.server.url], timeout=self.timeout, retries=self.retries, concurrency=self.concurrency)
        return self.client

    def start(self, mode: str = "capture") -> None:
        """Start (or check) the server for `mode` ("capture" | "generate") now instead of on first
        use, so that callers can time the work without the server start-up."""
        if mode not in ("capture", "generate"):
            raise ValueError(mode)
        self._ensure(mode)

    def _stop_server(self) -> None:
        if self.client is not None and not self.urls:
            self.client.close()
            self.client = None
        if self.server is not None:
            self.server.stop()
            self.server = None
            self.server_mode = None

    def close(self) -> None:
        self._stop_server()
        if self.client is not None:
            self.client.close()
            self.client = None
        shutil.rmtree(self._tmp, ignore_errors=True)

    def info(self) -> EngineInfo:
        # vLLM's id N is the last layer's output before the final norm
        return self._server_info("pre", urls=self.urls or "started", extract_layer_ids=[*self.layer_ids, self.num_layers])

    def _map(self, fn, batch: list[Request]) -> list:
        if len(batch) == 1 or self.concurrency == 1:
            return [fn(r) for r in batch]
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(batch))) as ex:
            return list(ex.map(fn, batch))

    def _model_name(self, client: Client) -> str:
        return client.model_card(client.urls[0])["id"]

    # -- capture
    def capture(self, batch: list[Request]) -> list[Captured | Failure]:
        client = self._ensure("capture")
        try:
            model = self._model_name(client)
        except RequestFailed as e:
            return [Failure(r.id, e.reason, e.message) for r in batch]
        return self._map(lambda r: self._capture_one(client, model, r), batch)

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
            resp = client.request("POST", "/v1/completions", payload)
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
        aux = hs[:, : L - 1].reshape(T, (L - 1) * self.hidden_size)  # [T, 3H]: layers in order, like torch.cat
        last = hs[:, L - 1].contiguous()  # [T, H], pre-norm
        return Captured(r.id, torch.tensor(tok.tolist(), dtype=torch.long), aux.contiguous(), last)

    # -- generation
    def generate(self, batch: list[Request], max_new_tokens: int, temperature: float = 0.0, seed: int = 0):
        client = self._ensure("generate")
        try:
            model = client.model_card(client.urls[0])
        except RequestFailed as e:
            return [Failure(r.id, e.reason, e.message) for r in batch]
        max_len = int(model.get("max_model_len") or self.max_model_len)
        return self._map(lambda r: self._generate_one(client, model["id"], max_len, r, max_new_tokens, temperature, seed), batch)

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
            resp = client.request("POST", "/v1/completions", payload)
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
