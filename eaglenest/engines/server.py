"""A server process eaglenest starts and stops itself (vLLM or SGLang, each from its own
virtualenv): bound to 127.0.0.1 on a free port, in its own process group, its output kept in a
log file, healthy before use, and never left behind -- stopped on close(), on errors and Ctrl-C,
and (Linux) killed by the kernel if eaglenest itself is killed (PR_SET_PDEATHSIG)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from eaglenest import EaglenestError

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # .../eaglenest


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pdeathsig():
    """A preexec_fn that makes the child get SIGTERM when its parent dies, or None where the OS
    has no prctl (the caller then says so once)."""
    try:
        import ctypes

        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def preexec() -> None:
        prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG

    return preexec


class ServerProcess:
    """One server subprocess.  `cmd_factory(port) -> argv`; `name` labels the messages;
    `health` is the path that answers 200 once the server serves; `pythonpath` are extra
    directories for the server's PYTHONPATH (after a directory that holds only `eaglenest`)."""

    def __init__(self, name: str, cmd_factory, *, workdir: Path, log_file: str | Path | None = None,
                 startup_timeout: float = 600.0, env: dict | None = None, health: str = "/health",
                 pythonpath: list[Path] | None = None):
        self.name = name
        self.cmd_factory = cmd_factory
        self.port = free_port()
        self.cmd = cmd_factory(self.port)
        self.workdir = Path(workdir)
        self.log_path = Path(log_file) if log_file else self.workdir / "server.log"
        self.startup_timeout = startup_timeout
        self.extra_env = dict(env or {})
        self.health = health
        self.extra_path = [str(p) for p in (pythonpath or [])]
        self.proc: subprocess.Popen | None = None
        self.url = f"http://127.0.0.1:{self.port}"
        self.start_seconds: float | None = None

    @property
    def path_dir(self) -> Path:
        """The directory first on the server's PYTHONPATH (holds `eaglenest`; callers may add to it)."""
        d = self.workdir / "pythonpath"
        d.mkdir(parents=True, exist_ok=True)
        return d

    def _env(self) -> dict:
        # only eaglenest (a symlink) and the given directories go on the server's path: never the
        # main venv's site-packages, which PYTHONPATH could otherwise point into
        link = self.path_dir / "eaglenest"
        if not link.exists():
            link.symlink_to(PACKAGE_DIR, target_is_directory=True)
        env = dict(os.environ)
        for k in ("PYTHONHOME", "VIRTUAL_ENV"):
            env.pop(k, None)
        env["PYTHONPATH"] = os.pathsep.join([str(self.path_dir), *self.extra_path])
        env.setdefault("DO_NOT_TRACK", "1")
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.update(self.extra_env)
        return env

    def start(self) -> "ServerProcess":
        try:
            for _ in range(2):
                if self._start_once():
                    return self
                # the free port was taken between our probe and the server's bind: once more
                self.port = free_port()
                self.cmd = self.cmd_factory(self.port)
                self.url = f"http://127.0.0.1:{self.port}"
            raise EaglenestError(f"{self.name} server could not bind a port; last lines of {self.log_path}:\n{self.log_tail()}")
        except BaseException:
            self.stop()  # also on Ctrl-C while waiting: never leave a server behind
            raise

    def _start_once(self) -> bool:
        import httpx

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        preexec = _pdeathsig()
        if preexec is None:
            print(f"{self.name}: warning: no prctl(PR_SET_PDEATHSIG) here: if eaglenest is killed, stop the server "
                  "yourself", file=sys.stderr)
        print(f"{self.name}: starting server on {self.url} (log: {self.log_path})", file=sys.stderr)
        t0 = time.time()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self._env(), start_new_session=True, preexec_fn=preexec)
        deadline = t0 + self.startup_timeout
        with httpx.Client(timeout=5.0) as c:
            while True:
                rc = self.proc.poll()
                if rc is not None:
                    self.stop()
                    tail = self.log_tail()
                    if "address already in use" in tail.lower():
                        return False
                    raise EaglenestError(f"{self.name} server exited with code {rc} while starting; last lines of "
                                         f"{self.log_path}:\n{tail}")
                try:
                    if c.get(self.url + self.health).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass  # not listening yet: that is what we are waiting for
                if time.time() > deadline:
                    tail = self.log_tail()
                    self.stop()
                    raise EaglenestError(f"{self.name} server not healthy after {self.startup_timeout:.0f}s; last lines "
                                         f"of {self.log_path}:\n{tail}")
                time.sleep(0.5)
        self.start_seconds = time.time() - t0
        print(f"{self.name}: server ready in {self.start_seconds:.1f}s", file=sys.stderr)
        return True

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError as e:
            return f"(no log: {e})"
        # engine-config lines can be huge: shorten long lines
        return "\n".join(ln if len(ln) < 600 else ln[:600] + " ..." for ln in lines[-n:])

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace: float = 30.0) -> None:
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            _killpg(proc.pid, signal.SIGTERM)  # our own process group (start_new_session)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                _killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        _killpg(proc.pid, signal.SIGKILL)  # the leader is gone: no child of its group may outlive it


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass  # the group is already gone: nothing left to stop
    except PermissionError:
        pass  # the group id was reused by a process that is not ours: not ours to stop
