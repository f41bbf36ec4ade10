"""The `--sglang-*` flags (one argument group per engine, engines/__init__.py) and the one check on
where the servers come from: running ones (`--sglang-url`) or one eaglenest starts (`--sglang-serve`)."""

from __future__ import annotations

from eaglenest import EaglenestError
from eaglenest.engines.sglang import plugin

MODES = ("plugin", "stock")


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

