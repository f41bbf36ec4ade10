"""The server engines' shared pieces: the HTTP client (engines/http.py: retries with backoff on
transient failures only, failure classification, its own account of every request, bounded
concurrency) against a scripted local HTTP server, and the server process (engines/server.py:
start-up failure and health timeout reported with the log, a server never outliving eaglenest)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from eaglenest import EaglenestError
from eaglenest.engines.http import Client, RequestFailed, describe, merge_stats
from eaglenest.engines.server import ServerProcess

REPO = Path(__file__).resolve().parents[1]


class Scripted:
    """127.0.0.1 server answering POST /x from a script: a list of actions consumed in order
    ("ok", an HTTP status, "slow", "garbage"); then "ok".  Records the bodies it got."""

    def __init__(self, script=(), slow: float = 2.0):
        outer = self
        self.script = list(script)
        self.bodies: list = []
        self.lock = threading.Lock()
        self.in_flight = self.peak = 0

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"null")
                with outer.lock:
                    outer.bodies.append(body)
                    action = outer.script.pop(0) if outer.script else "ok"
                    outer.in_flight += 1
                    outer.peak = max(outer.peak, outer.in_flight)
                try:
                    if action == "slow":
                        time.sleep(slow)
                    if action == "hold":  # keeps the request open until released: no timing involved
                        outer.release.wait(30)
                    if isinstance(action, int):
                        data, code = json.dumps({"error": "context length exceeded" if action == 400 else "x"}).encode(), action
                    elif action == "garbage":
                        data, code = b"<html>not json", 200
                    else:
                        data, code = json.dumps({"echo": body}).encode(), 200
                    self.send_response(code)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                finally:
                    with outer.lock:
                        outer.in_flight -= 1

        self.release = threading.Event()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def scripted():
    servers = []

    def make(script=(), **kw):
        s = Scripted(script, **kw)
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.close()


def client(url, **kw):
    kw.setdefault("timeout", 5.0)
    kw.setdefault("retries", 3)
    kw.setdefault("backoff", 0.01)
    return Client([url] if isinstance(url, str) else url, **kw)


def test_transient_failures_are_retried_and_accounted(scripted):
    s = scripted([503, 502, "ok"])
    with client(s.url) as c:
        assert c.request("POST", "/x", {"a": 1}, tag="s1") == {"echo": {"a": 1}}
        st = c.stats()
    assert st["requests"] == 1 and st["attempts"] == 3 and st["failed_attempts"] == {"http_5xx": 2}
    assert st["requests_retried"] == 1 and st["requests_failed"] == 0
    assert st["records"] == [{"tag": "s1", "method": "POST", "path": "/x", "failed_attempts": ["http_5xx", "http_5xx"],
                              "outcome": "ok", "attempts": 3}]


def test_persistent_5xx_fails_after_all_attempts(scripted):
    s = scripted([503] * 10)
    with client(s.url, retries=2) as c:
        with pytest.raises(RequestFailed) as e:
            c.request("POST", "/x", {}, tag="bad")
        st = c.stats()
    assert e.value.reason == "http_5xx" and "after 3 attempts" in e.value.message and e.value.status == 503
    assert len(s.bodies) == 3 and st["requests_failed"] == 1
    assert st["records"][0]["failed_attempts"] == ["http_5xx"] * 3 and st["records"][0]["outcome"] == "http_5xx"


def test_final_failures_are_not_retried(scripted):
    s = scripted([400, 404, "garbage"])
    with client(s.url) as c:
        reasons = []
        for _ in range(3):
            with pytest.raises(RequestFailed) as e:
                c.request("POST", "/x", {})
            reasons.append(e.value.reason)
        st = c.stats()
    assert reasons == ["too_long", "http_404", "bad_response"]  # 400 says "context length exceeded"
    assert len(s.bodies) == 3 and st["attempts"] == 3  # one attempt each


def test_timeout_and_refused_connections_are_transient(scripted):
    s = scripted(["slow", "ok"], slow=3.0)
    with client(s.url, timeout=0.5) as c:
        assert c.request("POST", "/x", {"k": 2})["echo"] == {"k": 2}
        assert c.stats()["records"][0]["failed_attempts"] == ["timeout"]
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with client(dead, retries=1) as c:
        with pytest.raises(RequestFailed) as e:
            c.request("GET", "/health")
    assert e.value.reason == "connection" and "after 2 attempts" in e.value.message


def test_fresh_payload_per_attempt_and_round_robin(scripted):
    a, b = scripted([503]), scripted()
    with client([a.url, b.url]) as c:
        c.request("POST", "/x", make_payload=lambda n: {"rid": f"r-a{n}"})
    assert a.bodies == [{"rid": "r-a0"}] and b.bodies == [{"rid": "r-a1"}]  # the retry went to the next URL


def test_map_keeps_order_and_bounds_concurrency(scripted):
    s = scripted(["hold"] * 6)
    with client(s.url, concurrency=2) as c:
        done = []

        def fn(i):
            out = c.request("POST", "/x", {"i": i})["echo"]["i"]
            done.append(i)
            return out

        t = threading.Thread(target=lambda: done.append(c.map(fn, range(6))))
        t.start()
        for _ in range(200):  # wait until two requests are held open by the server
            if s.in_flight == 2:
                break
            time.sleep(0.01)
        s.release.set()
        t.join(30)
    assert done[-1] == list(range(6)) and s.peak == 2


def test_merge_and_describe():
    a = {"requests": 2, "attempts": 3, "failed_attempts": {"timeout": 1}, "requests_retried": 1, "requests_failed": 0,
         "records": [{"tag": "x"}]}
    b = {"requests": 1, "attempts": 2, "failed_attempts": {"timeout": 1, "http_5xx": 1}, "requests_retried": 0,
         "requests_failed": 1, "records": [{"tag": "y"}]}
    m = merge_stats(a, b)
    assert m["requests"] == 3 and m["failed_attempts"] == {"timeout": 2, "http_5xx": 1} and len(m["records"]) == 2
    assert describe(m) == ("3 requests, 5 attempts (1 retried to success, 1 failed; failed attempts by reason: "
                           "http_5xx: 1, timeout: 2)")


# ------------------------------------------------------------------------------ server process


def test_server_start_failure_shows_the_log_tail(tmp_path):
    srv = ServerProcess("test", lambda port: [sys.executable, "-c", f"print('cannot start on {port}: boom'); raise SystemExit(3)"],
                        workdir=tmp_path, startup_timeout=30)
    with pytest.raises(EaglenestError, match="test server exited with code 3(.|\n)*boom"):
        srv.start()
    assert srv.proc is None


def test_server_health_timeout_stops_the_process(tmp_path):
    srv = ServerProcess("test", lambda port: [sys.executable, "-c", "import time; print('loading', flush=True); time.sleep(60)"],
                        workdir=tmp_path, startup_timeout=1.5)
    with pytest.raises(EaglenestError, match="not healthy after 2s(.|\n)*loading"):
        srv.start()
    assert srv.proc is None


def test_the_server_path_holds_only_eaglenest_and_the_given_dirs(tmp_path):
    extra = tmp_path / "extra"
    srv = ServerProcess("test", lambda port: ["true"], workdir=tmp_path, pythonpath=[extra], env={"X_TEST": "1"})
    env = srv._env()
    assert env["PYTHONPATH"].split(os.pathsep) == [str(srv.path_dir), str(extra)] and env["X_TEST"] == "1"
    assert sorted(p.name for p in srv.path_dir.iterdir()) == ["eaglenest"]
    assert (srv.path_dir / "eaglenest" / "engines" / "server.py").exists()


def test_a_started_server_dies_with_its_parent(tmp_path):
    """If eaglenest is killed (SIGKILL: no cleanup runs), the server it started goes too."""
    pidfile = tmp_path / "pid"
    code = f"""
import sys, time
sys.path.insert(0, {str(REPO)!r})
from eaglenest.engines.server import ServerProcess
srv = ServerProcess("test", lambda port: [sys.executable, "-c", "import os,time; open({str(pidfile)!r},'w').write(str(os.getpid())); time.sleep(120)"],
                    workdir={str(tmp_path)!r}, startup_timeout=100)
srv.start()
"""
    parent = subprocess.Popen([sys.executable, "-c", code])
    for _ in range(100):
        if pidfile.exists() and pidfile.read_text():
            break
        time.sleep(0.1)
    child = int(pidfile.read_text())
    parent.kill()
    parent.wait()
    for _ in range(100):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        # a zombie of an exited child is reaped by init; check its state
        try:
            if Path(f"/proc/{child}/stat").read_text().split()[2] == "Z":
                break
        except FileNotFoundError:
            break
        time.sleep(0.1)
    else:
        os.kill(child, 9)
        raise AssertionError("the server outlived its parent")


def test_listen_addresses_reads_what_the_kernel_binds():
    """tests/netcheck.py (the live tests' loopback check) on sockets of known addresses."""
    import socket

    from netcheck import listen_addresses

    for host, want in (("127.0.0.1", {"127.0.0.1"}), ("0.0.0.0", {"0.0.0.0"})):
        s = socket.socket()
        s.bind((host, 0))
        port = s.getsockname()[1]
        assert listen_addresses(port) == set()  # bound, not listening yet
        s.listen()
        try:
            assert listen_addresses(port) == want
        finally:
            s.close()
