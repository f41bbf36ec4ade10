"""The measured numbers of README.md and docs/ are rendered from bench/results/ by bench/report.py,
and `report.py --check` (run here on the real tree, so in CI) fails on every way a figure could
reach a page without a result file behind it.  Each hole is tried on a small fake tree: a marker it
did not render (misindented, malformed, unknown module), a figure outside a block (README, docs/,
a code span, a fenced comment), a figure typed into a render module, free text with figures in a
result, a dirty commit, a commit without the script, a command the script no longer parses, rows
copied from another result, a result no block renders, a number edited by hand."""

from __future__ import annotations

import importlib.util
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


def test_the_real_tree_passes_the_check():
    p = run_report("--check")
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    blocks = {b for page in pages for b in re.findall(r"<!-- report:(\w+) -->", page.read_text())}
    assert {"summary", "losses", "train_step_ab"} <= blocks  # the README's table and the benchmark pages
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300  # a README a user reads in minutes


def test_a_number_edited_by_hand_fails_and_rewriting_restores_it(tmp_path):
    """On a copy of the real pages and results (their commits checked in this repository)."""
    for d in ("docs", "bench/results", "bench/render"):
        shutil.copytree(ROOT / d, tmp_path / d, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    readme = tmp_path / "README.md"
    text = readme.read_text()
    m = re.search(r"<!-- report:summary -->\n(.*?)<!-- /report:summary -->", text, re.S)
    number = re.search(r"\d+\.(\d)", m.group(1))  # the first decimal number of the table: change its first decimal
    bumped = str((int(number.group(1)) + 1) % 10)
    at = m.start(1) + number.start(1)
    readme.write_text(text[:at] + bumped + text[at + 1:])
    args = ["--root", str(tmp_path), "--repo", str(ROOT)]
    p = run_report("--check", *args)
    assert p.returncode == 1 and "README.md differs from its rendering" in p.stderr, p.stderr
    minus = [x for x in p.stdout.splitlines() if x.startswith("-") and not x.startswith("---")]
    plus = [x for x in p.stdout.splitlines() if x.startswith("+") and not x.startswith("+++")]
    assert len(minus) == len(plus) == 1 and bumped in minus[0], p.stdout  # the diff shows the edited line, and only it
    assert run_report(*args).returncode == 0 and readme.read_text() == text  # rewriting restores the rendering
    assert run_report("--check", *args).returncode == 0


# --- a small fake tree ----------------------------------------------------------------------------------
SCRIPT = """import argparse
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--note", default="")
    ap.parse_args()
    raise SystemExit("a dry parse must stop before the benchmark runs")
if __name__ == "__main__":
    main()
"""
MODULE = 'FILES = ["x.json"]\n\n\ndef render(results):\n    r = results["x.json"]\n    return f"tau {r[\'tau\']:.2f} on {r[\'prompts\']} prompts"\n'
README = "# t\n\nWhat x measured, on SGLang 0.5.23 with `--steps 3`:\n\n<!-- report:x -->\nold\n<!-- /report:x -->\n"


def git(root: Path, *a: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *a], cwd=root, check=True,
                          capture_output=True, text=True).stdout.strip()


@pytest.fixture(scope="module")
def report_module():
    spec = importlib.util.spec_from_file_location("bench_report_under_test", REPORT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def tree(tmp_path):
    """A repository with one benchmark script, its result at a clean commit, its render module and a
    README block: it passes the check, and each test breaks one thing."""
    (tmp_path / "bench" / "render").mkdir(parents=True)
    (tmp_path / "bench" / "results").mkdir()
    (tmp_path / "docs").mkdir()
    (tmp_path / "bench" / "x.py").write_text(SCRIPT)
    (tmp_path / "bench" / "render" / "x.py").write_text(MODULE)
    (tmp_path / "README.md").write_text(README)
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-qm", "x")
    write(tmp_path)
    return tmp_path


def write(root: Path, **fields) -> Path:
    r = {"tau": 1.5, "prompts": 80, "command": "python bench/x.py --n 3", "git_commit": git(root, "rev-parse", "HEAD"),
         "git_dirty": False, "date": "2026-12-05T00:00:00+00:00", "machine": {"cpu_model": "x"}}
    p = root / "bench" / "results" / "x.json"
    p.write_text(json.dumps({**r, **fields}))
    return p


def check(report_module, root: Path, capsys, *extra: str) -> tuple[int, str]:
    rc = report_module.main(["--check", "--root", str(root), *extra])
    return rc, capsys.readouterr().err


def test_the_fake_tree_renders_and_passes(report_module, tree, capsys):
    rc, err = check(report_module, tree, capsys)
    assert rc == 1 and "README.md differs from its rendering" in err and err.count("report:") == 1, err
    assert report_module.main(["--root", str(tree)]) == 0 and "rewrote" in capsys.readouterr().err
    assert "<!-- report:x -->\ntau 1.50 on 80 prompts\n<!-- /report:x -->" in (tree / "README.md").read_text()
    assert check(report_module, tree, capsys) == (0, "")


@pytest.fixture
def rendered(report_module, tree, capsys):
    assert report_module.main(["--root", str(tree)]) == 0
    capsys.readouterr()
    return tree


@pytest.mark.parametrize("page", [
    "<!-- report:x -->\ntau 1.50 on 80 prompts\n  <!-- /report:x -->\n",    # closed at another indentation
    "  <!-- report:x -->\n  tau 1.50 on 80 prompts\n<!-- /report:x -->\n",  # opened at another indentation
    "<!-- report:nothing -->\nx\n   <!-- /report:nothing -->\n",           # ... even where no module exists
    "<!--report:x-->\ntau 1.50 on 80 prompts\n<!-- /report:x -->\n",        # a marker not written as one
    "<!-- report:x --> <!-- /report:x -->\n",                                 # two on one line
    "<!-- report:x -->\ntau 1.50 on 80 prompts\n",                            # never closed
    "tau 1.50 on 80 prompts\n<!-- /report:x -->\n",                           # closes nothing
])
def test_a_marker_the_check_did_not_render_fails(report_module, rendered, capsys, page):
    (rendered / "docs" / "p.md").write_text("# p\n\n" + page)
    rc, err = check(report_module, rendered, capsys)
    assert rc == 1 and re.search(r"docs/p\.md:[345]: (block|malformed|the closing marker|'/report)", err), err


def test_a_block_naming_a_missing_module_or_file_fails(report_module, rendered, capsys):
    (rendered / "docs" / "p.md").write_text("<!-- report:nothing -->\nx\n<!-- /report:nothing -->\n")
    rc, err = check(report_module, rendered, capsys)
    assert rc == 1 and "nothing.py, which does not exist" in err, err
    (rendered / "docs" / "p.md").unlink()
    (rendered / "bench" / "render" / "y.py").write_text(MODULE.replace("x.json", "y.json"))
    (rendered / "docs" / "p.md").write_text("<!-- report:y -->\nx\n<!-- /report:y -->\n")
    rc, err = check(report_module, rendered, capsys)
    assert rc == 1 and "y.json, which is missing" in err, err


@pytest.mark.parametrize("prose,figure", [
    ("The demo decodes at τ 1.44 here.", "1.44"),
    ("vLLM accepted more on 14 of 20 prompts.", "14"),
    ("The interval was [-0.038, +0.081].", "0.038"),
    ("The eval takes `0.77` of the time.", "0.77"),                # a bare number in backticks is still a figure
    ("```bash\neaglenest demo   # ~5x faster\n```", "5x"),      # so is a shell comment
    ("```\ncapture: 1,501 tok/s\n```", "1,501"),                # and output shown as a plain block
    ("The step took 2.7 s; the demo 23 min.", "2.7"),
    ("| a | 40 % |", "40"),
])
def test_a_figure_outside_a_rendered_block_fails(report_module, rendered, capsys, prose, figure):
    for page in (rendered / "README.md", rendered / "docs" / "p.md"):
        before = page.read_text() if page.exists() else ""
        page.write_text(before + "\n" + prose + "\n")
        rc, err = check(report_module, rendered, capsys)
        assert rc == 1 and f"figure '{figure}' outside a rendered block" in err and page.name in err, err
        page.write_text(before) if before else page.unlink()
    assert check(report_module, rendered, capsys) == (0, "")


def test_facts_and_code_are_not_figures(report_module, rendered, capsys):
    (rendered / "docs" / "p.md").write_text(
        "# p\n\n1. Serve it with vLLM 0.32 or SGLang 0.5.23 (arXiv 2605.09992), EAGLE 3.1 flags, on 2 cores, TP 2.\n"
        "2. Layer 15 of SmolLM2-135M, Qwen2.5-Coder-0.5B, hidden 7168, rank 0, `--ttt-steps 7 --lr 1e-3`.\n"
        "3. A fact or a code span may wrap: served by vLLM\n   0.32, checked by `abs(tau_vllm - tau_ours) <=\n   0.05 * tau_ours`.\n\n"
        "```bash\neaglenest train --model smollm2 --draft-vocab 32000   # the vocabulary of the demo\n```\n")
    assert check(report_module, rendered, capsys) == (0, "")


def test_a_block_rendered_twice_fails(report_module, rendered, capsys):
    (rendered / "docs" / "p.md").write_text("<!-- report:x -->\ntau 1.50 on 80 prompts\n<!-- /report:x -->\n")
    rc, err = check(report_module, rendered, capsys)
    assert rc == 1 and "docs/p.md:1: block 'report:x' also appears in README.md" in err, err


def test_a_figure_typed_into_a_render_module_fails(report_module, rendered, capsys):
    m = rendered / "bench" / "render" / "x.py"
    m.write_text(m.read_text().replace("on {r[\'prompts\']} prompts", "on {r[\'prompts\']} prompts, 1.9x faster"))
    assert report_module.main(["--root", str(rendered)]) == 1  # rendering stops too
    rc, err = check(report_module, rendered, capsys)
    assert rc == 1 and "render/x.py:6: figure '1.9x' typed into a render module" in err, err


@pytest.mark.parametrize("fields,why", [
    ({"note": "the machine ran at 1.8 to 2.7 s a step"}, "note is free text with figures (1.8"),
    ({"runs": [{"note": "0.96 s an hour earlier"}]}, "runs[0].note is free text with figures (0.96"),
    ({"git_dirty": True}, "written from a dirty tree"),
    ({"git_dirty": None}, "lacks git_dirty"),
    ({"arms": {"a": {"tau": 1.4, "carried_from": {"date": "d"}}}}, "arms.a.carried_from holds rows carried"),
    ({"arms": {"a": {"tau": 1.4, "date": "d", "git_commit": "c", "machine": {}}}}, "arms.a holds rows carried"),
    ({"command": "python bench/x.py --n three"}, "does not parse with bench/x.py at HEAD (x.py: error: argument --n"),
    ({"command": "python bench/x.py --n 3 --label took 3.5 s", "label": "took 3.5 s"}, "label is free text with figures"),
    ({"command": "python bench/gone.py --n 3"}, "lacks bench/gone.py"),
    ({"command": "python -c 1"}, "its command names no script under bench/"),
    ({"git_commit": "0" * 40}, "is not in the repository"),
])
def test_a_result_file_that_breaks_a_rule_fails(report_module, rendered, capsys, fields, why):
    assert check(report_module, rendered, capsys) == (0, "")
    write(rendered, **fields)
    rc, err = check(report_module, rendered, capsys)
    assert rc == 1 and why in err, err


def test_a_command_is_recorded_so_that_it_parses_again(report_module, rendered, capsys, tmp_path, monkeypatch):
    """bench/common.write_result quotes the argv it records, so a note with spaces (and no figures)
    re-parses; the same argv joined with spaces, as files once were written, does not."""
    spec = importlib.util.spec_from_file_location("bench_common_for_report", ROOT / "bench" / "common.py")
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    monkeypatch.setattr(common, "RESULTS", tmp_path / "out")
    monkeypatch.setattr(sys, "argv", ["bench/x.py", "--n", "3", "--note", "a plain note"])
    command = json.loads(common.write_result("x", {"machine": {}}).read_text())["command"]
    write(rendered, command=command, note="a plain note")
    assert check(report_module, rendered, capsys) == (0, "")
    write(rendered, command=command.replace("'", ""), note="a plain note")
    rc, err = check(report_module, rendered, capsys)
    assert rc == 1 and "unrecognized arguments: plain note" in err, err


def test_a_result_whose_commit_lacks_its_script_fails(report_module, rendered, capsys):
    """The script added after the commit the result names (as gemv_rows_cpu.json's was)."""
    first = git(rendered, "rev-parse", "HEAD")
    (rendered / "bench" / "z.py").write_text(SCRIPT)
    git(rendered, "add", "bench/z.py")
    git(rendered, "commit", "-qm", "z")
    write(rendered, command="python bench/z.py --n 3", git_commit=first)
    rc, err = check(report_module, rendered, capsys)
    assert rc == 1 and f"commit {first[:12]} lacks bench/z.py" in err and "not at HEAD" not in err, err
    (rendered / "bench" / "z.py").unlink()
    git(rendered, "commit", "-qam", "no z")
    rc, err = check(report_module, rendered, capsys)
    assert rc == 1 and "bench/z.py, which its command runs, is not at HEAD" in err, err


def test_a_result_no_block_renders_fails_unless_retired(report_module, rendered, capsys, monkeypatch):
    (rendered / "bench" / "results" / "x.json").rename(rendered / "bench" / "results" / "old.json")
    write(rendered)
    rc, err = check(report_module, rendered, capsys)
    assert rc == 1 and "old.json: no block renders it" in err, err
    monkeypatch.setitem(report_module.RETIRED, "old.json", "a reason")
    assert check(report_module, rendered, capsys) == (0, "")
    monkeypatch.setitem(report_module.RETIRED, "x.json", "a reason")  # a retired file may not be rendered
    rc, err = check(report_module, rendered, capsys)
    assert rc == 1 and "x.json is retired (a reason) but a block renders it" in err, err


def test_a_missing_field_raises_and_is_never_defaulted(report_module, rendered, capsys):
    r = json.loads((rendered / "bench" / "results" / "x.json").read_text())
    del r["prompts"]
    (rendered / "bench" / "results" / "x.json").write_text(json.dumps(r))
    before = (rendered / "README.md").read_text()
    assert report_module.main(["--root", str(rendered)]) == 1
    assert "KeyError: 'prompts'" in capsys.readouterr().err and (rendered / "README.md").read_text() == before


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


def test_a_train_step_ab_file_of_another_cpu_kind_renders_with_no_code_change(report_module, tmp_path):
    """The train_step_ab block renders every train_step_ab_<recipe>_<cpu kind>.json it finds, one row per
    recipe and CPU kind, keyed by the data's `cpu_kind`: a copy of the real demo file as another kind's
    run adds its rows and nothing else changes."""
    render_dir, results = tmp_path / "render", tmp_path / "results"
    shutil.copytree(ROOT / "bench" / "render", render_dir, ignore=shutil.ignore_patterns("__pycache__"))
    results.mkdir()
    for p in (ROOT / "bench" / "results").glob("train_step_ab_*_amx.json"):  # one kind's files: no CPU column yet
        shutil.copy(p, results / p.name)
    one = report_module.render_block("train_step_ab", render_dir, results, read := set())
    assert read == {p.name for p in results.iterdir()} and "| CPU |" not in one
    other = json.loads((results / "train_step_ab_demo_amx.json").read_text())
    other["cpu_kind"], other["machine"]["cpu_model"] = "othercpu", "Another CPU"
    (results / "train_step_ab_demo_othercpu.json").write_text(json.dumps(other))
    two = report_module.render_block("train_step_ab", render_dir, results, read := set())
    rows = [x for x in two.splitlines() if x.startswith("| ") and "---" not in x][1:]
    assert "train_step_ab_demo_othercpu.json" in read and len(rows) == len(read) == 3
    assert [x.split(" | ")[0] for x in rows] == ["| amx", "| othercpu", "| amx"]  # by recipe, then CPU kind
    assert "Intel(R) Xeon(R) Processor (amx), Another CPU (othercpu)" in two
    assert all(f"| amx {x}" in two for x in one.splitlines()[4:])  # the amx rows, unchanged but for their CPU cell


def test_the_harness_runs_a_benchmark_as_its_own_script(tmp_path, monkeypatch, capsys):
    """`python -m bench NAME ARGS` runs bench/NAME.py as __main__ with argv bench/NAME.py ARGS, so the command
    its result records (bench/common.write_result) is the script's own, which report.py re-parses."""
    spec = importlib.util.spec_from_file_location("bench_main_under_test", ROOT / "bench" / "__main__.py")
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "x.py").write_text('"""X measured."""\nimport sys\nif __name__ == "__main__":\n    print(sys.argv)\n')
    (tmp_path / "bench" / "common.py").write_text('"""shared"""\n')
    monkeypatch.setattr(harness, "HERE", tmp_path / "bench")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert harness.main(["x", "--n", "3"]) == 0
    assert capsys.readouterr().out.strip() == "['bench/x.py', '--n', '3']"
    assert harness.main([]) == 0 and "x " in capsys.readouterr().out and "common" not in harness.benchmarks()
    with pytest.raises(SystemExit, match="no benchmark 'common'"):
        harness.main(["common"])
    p = subprocess.run([sys.executable, "-m", "bench"], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0 and "train_step" in p.stdout and "report" in p.stdout, p.stderr


def test_train_step_ab_refuses_fewer_steps_than_one_loss_window():
    """`train_step ab` compares losses in windows of WINDOW steps: fewer steps are refused when the
    arguments are read (before any worktree or training), naming the least it takes."""
    p = subprocess.run([sys.executable, "-m", "bench", "train_step", "ab", "--base", "HEAD", "--steps", "5"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--steps 5: at least 10" in p.stderr, p.stderr[-2000:]
