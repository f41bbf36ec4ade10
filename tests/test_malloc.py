"""Every CLI command keeps glibc's freed heap for reuse (utils.keep_freed_heap): a loop that
allocates and frees a large tensor, as each capture batch and training step does, stops faulting
its pages in again.  Counted in page faults, not time: the same on every CPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from eaglenest.utils import _glibc

pytestmark = pytest.mark.skipif(_glibc() is None, reason="glibc only (the tuning is a no-op elsewhere)")

# `cli` goes through eaglenest's real process entry (`python -m eaglenest`, a command that fails
# fast), then counts the minor page faults of ten 64 MiB allocate / fill / free rounds after a first one
CODE = """
import ctypes, resource, runpy, sys, torch
ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE: faults count 4 KiB pages whatever the machine's THP setting
if sys.argv[1] == "cli":
    sys.argv = ["eaglenest", "features", "info", "/nonexistent-store"]
    try:
        runpy.run_module("eaglenest", run_name="__main__")
    except SystemExit as e:
        assert e.code == 2, e.code
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
x = torch.ones(1 << 24); del x
f0 = faults()
for _ in range(10):
    x = torch.ones(1 << 24); del x
print(faults() - f0)
"""


def _faults(mode: str, **env) -> int:
    e = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "EAGLENEST_SYSTEM_MALLOC"}
    r = subprocess.run([sys.executable, "-c", CODE, mode], env={**e, **env}, capture_output=True, text=True, check=True)
    return int(r.stdout.strip())


def test_cli_commands_reuse_freed_memory_and_the_user_can_opt_out():
    plain = _faults("plain")  # also what a process that only calls cli.main (a test, a notebook) keeps
    assert plain >= 10 * 8192, plain  # glibc's default: each 64 MiB round is a fresh mmap (16384 pages of 4 KiB)
    assert _faults("cli") * 5 < plain  # reused: at most a round's worth of new pages in ten rounds
    assert _faults("cli", EAGLENEST_SYSTEM_MALLOC="1") >= 0.9 * plain
    assert _faults("cli", MALLOC_TRIM_THRESHOLD_="131072") >= 0.9 * plain  # the user's own glibc settings win
