"""The README's measured numbers are rendered from bench/results/ (bench/report.py, issue 22): the
committed README equals a fresh rendering, and the check fails on a hand-edited number, on a
result file without provenance, on a block whose module or file is missing, and on a render
module that reads a field its file does not have."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
REPORT = ROOT / "bench" / "report.py"


def run_report(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPORT), *args], capture_output=True, text=True, cwd=ROOT)


def test_readme_equals_its_rendering_from_the_result_files():
    p = run_report("--check")
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    blocks = re.findall(r"<!-- report:(\w+) -->", (ROOT / "README.md").read_text())
    assert "measured" in blocks  # the measured-results table is one of them


@pytest.fixture
def copy(tmp_path):
    """README, results and render modules copied, so a test can damage one of them."""
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    shutil.copytree(ROOT / "bench" / "results", tmp_path / "results")
    shutil.copytree(ROOT / "bench" / "render", tmp_path / "render", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def args(d: Path) -> list[str]:
    return ["--readme", str(d / "README.md"), "--results", str(d / "results"), "--render-dir", str(d / "render")]


def test_check_fails_on_a_number_edited_by_hand_and_rewrite_restores_it(copy):
    text = (copy / "README.md").read_text()
    m = re.search(r"<!-- report:measured -->\n(.*?)<!-- /report:measured -->", text, re.S)
    body = m.group(1)
    number = re.search(r"\d+\.(\d)", body)  # the first decimal number in the table: change its first decimal
    bumped = str((int(number.group(1)) + 1) % 10)
    edited_body = body[: number.start(1)] + bumped + body[number.end(1):]
    (copy / "README.md").write_text(text[: m.start(1)] + edited_body + text[m.end(1):])
    p = run_report("--check", *args(copy))
    assert p.returncode == 1
    minus = [x for x in p.stdout.splitlines() if x.startswith("-") and not x.startswith("---")]
    plus = [x for x in p.stdout.splitlines() if x.startswith("+") and not x.startswith("+++")]
    assert len(minus) == len(plus) == 1 and bumped in minus[0], p.stdout  # the diff shows the edited line, and only it
    assert run_report(*args(copy)).returncode == 0  # rewriting restores the rendering
    assert (copy / "README.md").read_text() == text
    assert run_report("--check", *args(copy)).returncode == 0


def test_check_fails_on_a_result_file_without_provenance(copy):
    f = copy / "results" / "capture_cpu.json"  # a file the measured block reads
    r = json.loads(f.read_text())
    for field in ("command", "git_commit", "date", "machine"):
        bad = dict(r)
        del bad[field]
        f.write_text(json.dumps(bad))
        p = run_report("--check", *args(copy))
        assert p.returncode == 1 and "capture_cpu.json" in p.stderr and f"lacks {field}" in p.stderr, p.stderr
    # a file no block reads is held to the same rule: every result is written by its script
    f.write_text(json.dumps(r))
    (copy / "results" / "by_hand.json").write_text(json.dumps({"tau": 9.9, "date": "today"}))
    p = run_report("--check", *args(copy))
    assert p.returncode == 1 and "by_hand.json: lacks command, git_commit, machine" in p.stderr, p.stderr


def test_check_fails_on_a_missing_module_a_missing_file_or_an_unclosed_block(copy):
    readme = copy / "README.md"
    text = readme.read_text()
    readme.write_text(text + "\n<!-- report:no_such_module -->\nx\n<!-- /report:no_such_module -->\n")
    p = run_report("--check", *args(copy))
    assert p.returncode == 1 and "no_such_module.py, which does not exist" in p.stderr, p.stderr

    readme.write_text(text + "\n<!-- report:measured -->\nsecond copy\n")
    p = run_report("--check", *args(copy))
    assert p.returncode == 1 and ("opens inside" in p.stderr or "never closed" in p.stderr), p.stderr

    readme.write_text(text)
    (copy / "results" / "online.json").unlink()
    p = run_report("--check", *args(copy))
    assert p.returncode == 1 and "needs" in p.stderr and "online.json, which is missing" in p.stderr, p.stderr
    assert run_report(*args(copy)).returncode == 1 and readme.read_text() == text  # nothing written on an error


def test_a_missing_field_raises_and_is_never_defaulted(tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "render").mkdir()
    prov = {"command": "python bench/x.py", "git_commit": "0" * 40, "date": "2026-12-02", "machine": {"cpu_model": "x"}}
    (tmp_path / "results" / "x.json").write_text(json.dumps({**prov, "tau": 1.5}))
    (tmp_path / "render" / "x.py").write_text(
        'FILES = ["x.json"]\n\ndef render(results):\n    r = results["x.json"]\n'
        '    return f"tau {r[\'tau\']:.2f}, speedup {r[\'speedup\']:.2f}x"\n')
    readme = tmp_path / "README.md"
    readme.write_text("# t\n\n<!-- report:x -->\nold\n<!-- /report:x -->\n")
    p = run_report(*args(tmp_path))
    assert p.returncode == 1 and "KeyError: 'speedup'" in p.stderr and "x.py" in p.stderr, p.stderr
    assert readme.read_text().count("old") == 1
    (tmp_path / "results" / "x.json").write_text(json.dumps({**prov, "tau": 1.5, "speedup": 0.9}))
    assert run_report(*args(tmp_path)).returncode == 0
    assert readme.read_text() == "# t\n\n<!-- report:x -->\ntau 1.50, speedup 0.90x\n<!-- /report:x -->\n"


def test_git_state_counts_code_changes_not_result_files(tmp_path):
    """A result records the commit it ran at and whether the code differed from it; a benchmark
    series run from one commit rewrites result files in turn, which must not count as dirty; a
    script not yet committed does count (gemv_rows_cpu.json named a commit without its script)."""
    import importlib.util

    (tmp_path / "bench" / "results").mkdir(parents=True)
    shutil.copy(ROOT / "bench" / "common.py", tmp_path / "bench" / "common.py")
    (tmp_path / "bench" / "results" / "a.json").write_text("{}\n")

    def git(*a):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *a], cwd=tmp_path, check=True,
                              capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "x")
    spec = importlib.util.spec_from_file_location("bench_common_copy", tmp_path / "bench" / "common.py")
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    assert common.git_state() == {"git_commit": git("rev-parse", "HEAD"), "git_dirty": False}
    (tmp_path / "bench" / "results" / "a.json").write_text('{"tau": 1}\n')  # an earlier benchmark of the series
    assert common.git_state()["git_dirty"] is False
    (tmp_path / "bench" / "results" / "b.json").write_text("{}\n")  # a new result file, untracked
    assert common.git_state()["git_dirty"] is False
    (tmp_path / "bench" / "new_bench.py").write_text("print(1)\n")  # a script not yet committed: not in the commit
    assert common.git_state()["git_dirty"] is True
    (tmp_path / "bench" / "new_bench.py").unlink()
    (tmp_path / "bench" / "common.py").write_text((tmp_path / "bench" / "common.py").read_text() + "\n# edited\n")
    assert common.git_state()["git_dirty"] is True
