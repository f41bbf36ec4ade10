"""The benchmark harness: one entry over the benchmark modules of this folder.

    python -m bench                 # list the benchmarks
    python -m bench NAME [ARGS...]  # run bench/NAME.py with ARGS (its own --help says what it takes)

Each benchmark stays a script of its own, run here as `__main__` under its own path, so the command
its result file records is `python bench/NAME.py ARGS...` either way: bench/report.py re-parses that
command with the script at HEAD, and the results written before this entry keep parsing.  What the
benchmarks share (machine info, git state, alternating arms, child processes, result files) is
bench/common.py; the demo-recipe arms (one capture, many trainings, one decode) are bench/arms.py."""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
HELPERS = {"__main__", "common"}  # modules, not benchmarks


def benchmarks() -> dict[str, str]:
    """{name: the first line of its docstring}."""
    out = {}
    for p in sorted(HERE.glob("*.py")):
        if p.stem not in HELPERS:
            doc = p.read_text().split('"""')
            out[p.stem] = doc[1].strip().splitlines()[0] if len(doc) > 2 else ""
    return out


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.split("\n\n")[0] + "\n\nbenchmarks:")
        for name, what in benchmarks().items():
            print(f"  {name:<18} {what}")
        return 0
    name, *rest = argv
    path = HERE / f"{name}.py"
    if name in HELPERS or not path.is_file():
        raise SystemExit(f"python -m bench: no benchmark {name!r} (one of: {', '.join(benchmarks())})")
    # run under its path relative to here (the repository root, as documented): run_path makes that argv[0],
    # so the command a result records is `python bench/NAME.py ARGS`
    script = os.path.relpath(path)
    sys.argv = [script, *rest]
    sys.path.insert(0, str(HERE))  # what `python bench/NAME.py` puts first, so its sibling imports resolve alike
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
