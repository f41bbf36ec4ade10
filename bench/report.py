"""Render the README's measured numbers from the benchmark result files (issue 22).

    python bench/report.py            # rewrite every block of README.md
    python bench/report.py --check    # exit 1 (with a unified diff) when README.md differs from a fresh rendering

The README holds blocks

    <!-- report:NAME -->
    ...generated markdown...
    <!-- /report:NAME -->

and each NAME is a module `bench/render/NAME.py` with

    FILES = ["x.json", ...]                          # result files under bench/results/
    def render(results: dict[str, dict]) -> str      # results[file] = the parsed JSON; returns markdown

A render module reads fields with `r["field"]` (a missing field raises; nothing is defaulted).
The run fails, naming the cause, when a block names a module that does not exist, a module's file
is missing, any result file under bench/results/ lacks its provenance (`command`, `git_commit`,
`date`, `machine`: what bench/common.write_result records), or a block is not closed.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROVENANCE = ("command", "git_commit", "date", "machine")
# a block may sit inside a list item: its markers' indentation is given to every rendered line
BLOCK = re.compile(r"^([ \t]*)(<!-- report:([A-Za-z0-9_]+) -->\n)(.*?)^(\1<!-- /report:\3 -->)", re.S | re.M)
MARKER = re.compile(r"<!-- (/?)report:([^ ]*) -->")


class ReportError(Exception):
    """A README block that cannot be rendered from its files."""


def missing_provenance(result: dict) -> list[str]:
    return [k for k in PROVENANCE if result.get(k) in (None, "")]


def load_result(path: Path) -> dict:
    try:
        r = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ReportError(f"{path}: cannot read a result file ({e})") from e
    if not isinstance(r, dict):
        raise ReportError(f"{path}: a result file must hold a JSON object")
    lacks = missing_provenance(r)
    if lacks:
        raise ReportError(f"{path}: lacks {', '.join(lacks)} (a result is written by its benchmark script through "
                          "bench/common.write_result, never by hand)")
    return r


def check_results_dir(results_dir: Path) -> list[str]:
    """Every JSON under the results folder carries its provenance, whether a block uses it or not."""
    errors = []
    for p in sorted(results_dir.glob("*.json")):
        try:
            load_result(p)
        except ReportError as e:
            errors.append(str(e))
    return errors


def load_module(name: str, render_dir: Path):
    path = render_dir / f"{name}.py"
    if not path.is_file():
        raise ReportError(f"README block 'report:{name}' names {path}, which does not exist")
    spec = importlib.util.spec_from_file_location(f"eaglenest_render_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    if str(render_dir) not in sys.path:  # render modules may share helpers of their folder (last: never shadows a library)
        sys.path.append(str(render_dir))
    spec.loader.exec_module(mod)
    for attr in ("FILES", "render"):
        if not hasattr(mod, attr):
            raise ReportError(f"{path}: defines no {attr}")
    return mod


def render_block(name: str, render_dir: Path, results_dir: Path) -> str:
    """The markdown between the markers of block NAME (ends with a newline)."""
    mod = load_module(name, render_dir)
    results = {}
    for f in mod.FILES:
        p = results_dir / f
        if not p.is_file():
            raise ReportError(f"render module {name}.py needs {p}, which is missing")
        results[f] = load_result(p)
    try:
        text = mod.render(results)
    except (KeyError, IndexError, TypeError) as e:
        raise ReportError(f"render module {name}.py: a field is missing or malformed in {list(mod.FILES)}: "
                          f"{type(e).__name__}: {e}") from e
    return text.strip("\n") + "\n"


def check_markers(readme: str) -> list[str]:
    """Opening and closing markers pair up one to one, in order, with nothing nested."""
    errors, open_name = [], None
    for m in MARKER.finditer(readme):
        line = readme.count("\n", 0, m.start()) + 1
        closing, name = m.group(1) == "/", m.group(2)
        if not re.fullmatch(r"[A-Za-z0-9_]+", name):
            errors.append(f"README line {line}: bad block name '{name}'")
        elif not closing and open_name is not None:
            errors.append(f"README line {line}: block 'report:{name}' opens inside 'report:{open_name}'")
        elif closing and open_name != name:
            errors.append(f"README line {line}: '/report:{name}' closes no open block")
        open_name = None if closing else name
    if open_name is not None:
        errors.append(f"README: block 'report:{open_name}' is never closed")
    return errors


def render_readme(readme: str, render_dir: Path, results_dir: Path) -> tuple[str, list[str]]:
    """(the README with every block re-rendered, errors).  A block that fails is left as it was."""
    errors = check_markers(readme)
    names = [m.group(3) for m in BLOCK.finditer(readme)]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        errors.append(f"README: block(s) {', '.join(dup)} appear more than once")

    def sub(m: re.Match) -> str:
        indent = m.group(1)
        try:
            body = render_block(m.group(3), render_dir, results_dir)
        except ReportError as e:
            errors.append(str(e))
            return m.group(0)
        body = "".join(indent + line if line.strip() else line for line in body.splitlines(keepends=True))
        return indent + m.group(2) + body + m.group(5)

    out = BLOCK.sub(sub, readme)
    errors += check_results_dir(results_dir)
    return out, list(dict.fromkeys(errors))  # a file both a block and the folder scan reject: said once


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 when the README differs from a fresh rendering")
    ap.add_argument("--readme", type=Path, default=ROOT / "README.md")
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--render-dir", type=Path, default=ROOT / "bench" / "render")
    a = ap.parse_args(argv)
    old = a.readme.read_text()
    new, errors = render_readme(old, a.render_dir.resolve(), a.results)
    for e in errors:
        print(f"report: {e}", file=sys.stderr)
    if a.check:
        diff = list(difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True),
                                         f"{a.readme} (as committed)", f"{a.readme} (rendered from {a.results})"))
        if diff:
            sys.stdout.writelines(diff)
            print(f"report: {a.readme} differs from its rendering: run `python bench/report.py`", file=sys.stderr)
        return 1 if diff or errors else 0
    if errors:
        print("report: nothing written", file=sys.stderr)
        return 1
    if new != old:
        a.readme.write_text(new)
        print(f"report: rewrote {a.readme}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
