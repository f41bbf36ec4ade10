"""What the benchmarks share: machine/version info, git state, the order of alternating arms, one arm
in a child process, and result files (`python -m bench NAME` runs a benchmark: bench/__main__.py)."""

from __future__ import annotations

import json
import os
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"  # a benchmark's --results-dir may point it elsewhere
_TRACKED_RESULTS = RESULTS  # the repo's own results folder, excluded from the dirty check wherever RESULTS points


def machine() -> dict:
    from eaglenest.utils import machine_info

    return machine_info()


def cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and its finished children (workers, subprocesses)."""
    import resource

    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)))


def git_state() -> dict:
    """The commit the benchmark ran at and whether the tree had uncommitted changes (a result from a
    dirty tree cannot be reproduced from its commit alone).  Untracked files count (a script not yet
    committed is not in the commit); result files do not: a series of benchmarks run from one commit
    rewrites them one after the other."""
    import subprocess

    root = Path(__file__).resolve().parent.parent

    def git(*a):
        return subprocess.run(["git", *a], cwd=root, capture_output=True, text=True, check=True).stdout.strip()

    try:
        dirty = git("status", "--porcelain", "--untracked-files=all", "--", ".", f":(exclude){_TRACKED_RESULTS.relative_to(root)}")
        return {"git_commit": git("rev-parse", "HEAD"), "git_dirty": bool(dirty)}
    except (OSError, subprocess.CalledProcessError):
        return {"git_commit": None, "git_dirty": None}  # not a git checkout (an unpacked release): said, not guessed


def _git(*args) -> str:
    import subprocess

    return subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True,
                          check=True).stdout.strip()


def git_tree(cache: Path, rev: str) -> tuple[Path, str]:
    """A worktree of this repository at `rev` (made once, under `cache`/trees): (path, full commit).  An
    earlier commit's code runs from it with PYTHONPATH=path (its own eaglenest, not this tree's)."""
    commit = _git("rev-parse", rev)
    path = cache / "trees" / commit[:12]
    if not (path / "eaglenest").is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
        _git("worktree", "add", "--force", "--detach", str(path), commit)
    return path, commit


def rotations(arms, rounds: int) -> list[list]:
    """The order of the arms in each of `rounds` rounds, rotated by one each round (two arms: A B, B A, ...),
    so that the machine's drift (load, heat, caches) falls on every arm alike and pairs share it."""
    arms = list(arms)
    return [arms[i % len(arms):] + arms[:i % len(arms)] for i in range(rounds)]


def child_result(cmd: list[str], **kw) -> dict:
    """Run one arm of a benchmark in a fresh interpreter (`cmd`, subprocess.run keywords in `kw`) and
    return the dict it printed on its `RESULT {json}` line, or {"error": the end of its stderr}."""
    import subprocess

    out = subprocess.run(cmd, capture_output=True, text=True, **kw)
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line[0][7:]) if line else {"error": out.stderr[-2000:]}


def write_result(name: str, result: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    result.setdefault("date", datetime.now(timezone.utc).isoformat(timespec="seconds"))
    result.setdefault("command", shlex.join([os.path.basename(sys.executable)] + sys.argv))  # re-runnable as written
    result.setdefault("machine", machine())
    for k, v in git_state().items():
        result.setdefault(k, v)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return path
