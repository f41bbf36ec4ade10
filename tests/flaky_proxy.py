"""A fault-injecting HTTP proxy on 127.0.0.1, put in front of a real engine server (vLLM's
/v1/completions or SGLang's /generate) by the reliability tests.

Faults are chosen per request by the request's prompt -- vLLM's `prompt`, or SGLang's `input_ids`
(a one-sample batch: send with --sglang-batch 1) -- so that they hit a known sample whatever the
concurrency, each for the first `times` requests carrying that prompt (None: every time):

  "503"      answer HTTP 503 without forwarding
  "reset"    drop the connection without an answer (TCP RST)
  "timeout"  hold the connection for `hold` seconds, then drop it (the client times out first)
  "restart"  the proxy goes away: its listening socket closes for `down` seconds (connections
             refused, in-flight requests reset), like a server restarting, then comes back
  "echo"     forward, then corrupt the echoed prompt_token_ids (drop the last id)
  "nan"      forward, then write NaN into the hidden-state file the server staged (vLLM)

`bodies` keeps every request body the proxy saw (tests check what the client sent).
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class _Server(ThreadingHTTPServer):
    allow_reuse_address = True
    daemon_threads = True


class FlakyProxy:
    def __init__(self, upstream: str, faults: dict[tuple[int, ...], tuple[str, int | None]] | None = None,
                 hold: float = 30.0, down: float = 3.0):
        import httpx

        self.upstream = upstream.rstrip("/")
        self.faults = dict(faults or {})
        self.hold, self.down = hold, down
        self.hits: dict[tuple[int, ...], int] = {}
        self.log: list[tuple[str, str, int]] = []  # (fault or "ok", path, hash of the prompt)
        self.bodies: list[dict] = []
        self.lock = threading.Lock()
        self.http = httpx.Client(timeout=600.0)
        self.httpd: _Server | None = None
        self.port = 0
        self._bind()

    # -- lifecycle
    def _bind(self) -> None:
        outer = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _reset(self):
                # SO_LINGER 0: close() sends RST instead of FIN -- a "connection reset by peer"
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.close_connection = True
                self.connection.close()

            def _send(self, status: int, body: bytes, ctype: str = "application/json"):
                self.send_response(status)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                r = outer.http.get(outer.upstream + self.path)
                self._send(r.status_code, r.content, r.headers.get("content-type", "application/json"))

            def do_POST(self):
                raw = self.rfile.read(int(self.headers.get("content-length") or 0))
                payload = json.loads(raw or b"{}")
                outer.bodies.append(payload)
                prompt = prompt_of(payload)
                fault = outer._fault_for(prompt)
                outer.log.append((fault or "ok", self.path, hash(tuple(prompt or ()))))
                if fault == "503":
                    return self._send(503, b'{"error": "injected: service unavailable"}')
                if fault == "reset":
                    return self._reset()
                if fault == "timeout":
                    time.sleep(outer.hold)
                    return self._reset()
                if fault == "restart":
                    threading.Thread(target=outer.restart, daemon=True).start()
                    return self._reset()
                r = outer.http.post(outer.upstream + self.path, content=raw, headers={"content-type": "application/json"})
                body = r.content
                if r.status_code == 200 and fault in ("echo", "nan"):
                    data = r.json()
                    if fault == "echo" and isinstance(data, list):  # SGLang: a batch of outputs
                        data[0]["prompt_token_ids"] = data[0]["prompt_token_ids"][:-1]
                    elif fault == "echo":
                        data["choices"][0]["prompt_token_ids"] = data["choices"][0]["prompt_token_ids"][:-1]
                    else:
                        poison_hidden_states(data["kv_transfer_params"]["hidden_states_path"])
                    body = json.dumps(data).encode()
                self._send(r.status_code, body)

        self.httpd = _Server(("127.0.0.1", self.port), H)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def restart(self) -> None:
        """Close the listening socket for `down` seconds, then listen again on the same port."""
        httpd, self.httpd = self.httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
        time.sleep(self.down)
        self._bind()

    def close(self) -> None:
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
        self.http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- faults
    def seen(self, prompt) -> list[str]:
        """What the proxy did to each request carrying `prompt`, in arrival order ("ok" = forwarded)."""
        h = hash(tuple(prompt))
        return [k for k, _, ph in self.log if ph == h]

    def _fault_for(self, prompt) -> str | None:
        key = tuple(prompt) if isinstance(prompt, list) else None
        with self.lock:
            if key not in self.faults:
                return None
            kind, times = self.faults[key]
            n = self.hits.get(key, 0)
            self.hits[key] = n + 1
            return kind if times is None or n < times else None


# what the client must have logged for an attempt the proxy treated this way ("ok": forwarded)
CLIENT_REASON = {"503": "http_5xx", "reset": "connection", "timeout": "timeout", "restart": "connection",
                 "echo": "ok", "nan": "ok", "ok": "ok"}


def check_client_account(record: dict | None, seen: list[str]) -> None:
    """The client's own record of one sample's request (engines/http.py; None: one clean attempt)
    against what the proxy did to each of its attempts, in order.  Every attempt reached the proxy;
    an injected fault must be logged with its reason; a forwarded attempt either succeeded or timed
    out on the client's side (a slow server: a real timeout, not an injected one)."""
    failed = record["failed_attempts"] if record else []
    outcome = record["outcome"] if record else "ok"
    logged = failed + (["ok"] if outcome == "ok" else [])
    assert len(logged) == len(seen), (logged, seen)
    for got, did in zip(logged, seen):
        want = CLIENT_REASON[did]
        assert got == want or (did in ("ok", "echo", "nan") and got == "timeout"), (logged, seen)


def prompt_of(payload: dict):
    """The one prompt of a request: vLLM's `prompt`, or the only row of SGLang's `input_ids`."""
    if "prompt" in payload:
        return payload["prompt"]
    ids = payload.get("input_ids")
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return ids[0] if len(ids) == 1 else None
    return ids


def poison_hidden_states(path: str) -> None:
    """Overwrite one value of a staged hidden-state file with NaN (after its writer is done)."""
    import fcntl

    from safetensors.torch import load_file, save_file

    with open(path + ".lock", "a+") as lf:
        fcntl.flock(lf, fcntl.LOCK_EX)  # the connector's writer holds it until the file is complete
        t = load_file(path)
        t["hidden_states"][len(t["hidden_states"]) // 2, 0, 0] = float("nan")
        save_file(t, path)
        fcntl.flock(lf, fcntl.LOCK_UN)
