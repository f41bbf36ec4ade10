"""The SGLang engine package (eaglenest/engines/sglang/): one module per concern, no import cycle
between them (read from the source, function-level imports included), each module imports alone
in a fresh interpreter, and what the SGLang virtualenv imports (the launcher and its parent
packages) loads nothing beyond the stdlib of eaglenest's dependencies."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import eaglenest
from eaglenest.engines import engine_modules

PKG = "eaglenest.engines.sglang"
ROOT = Path(eaglenest.__file__).resolve().parent / "engines" / "sglang"
MODULES = sorted(p.stem for p in ROOT.glob("*.py") if p.stem != "__init__")


def _imports(path: Path) -> set[str]:
    """The sibling modules `path` imports anywhere in its source (lazy imports included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == PKG:
                out |= {a.name for a in node.names if a.name in MODULES}
            elif node.module.startswith(PKG + "."):
                out.add(node.module[len(PKG) + 1:].split(".")[0])
        elif isinstance(node, ast.Import):
            out |= {a.name[len(PKG) + 1:].split(".")[0] for a in node.names if a.name.startswith(PKG + ".")}
    return out - {path.stem}


def test_no_import_cycle_between_the_modules():
    graph = {m: _imports(ROOT / f"{m}.py") for m in MODULES}
    assert graph["plugin"] == {"launcher"} and graph["launcher"] == set()  # both run inside SGLang's environment
    done, visiting = set(), []

    def visit(m):
        assert m not in visiting, "import cycle: " + " -> ".join(visiting[visiting.index(m):] + [m])
        if m in done:
            return
        visiting.append(m)
        for d in sorted(graph[m]):
            visit(d)
        visiting.pop()
        done.add(m)

    for m in MODULES:
        visit(m)
    # the package's __init__ (imported first by every module) needs only the flags
    assert _imports(ROOT / "__init__.py") == {"flags", "engine"}


def test_the_cycle_check_finds_a_cycle(tmp_path, monkeypatch):
    """The check above is not vacuous: two modules importing each other are caught."""
    (tmp_path / "a.py").write_text(f"from {PKG} import b\n")
    (tmp_path / "b.py").write_text(f"def f():\n    from {PKG}.a import x\n")
    monkeypatch.setattr(sys.modules[__name__], "MODULES", ["a", "b"])
    assert _imports(tmp_path / "a.py") == {"b"} and _imports(tmp_path / "b.py") == {"a"}


@pytest.mark.parametrize("module", ["__init__", *MODULES])
def test_each_module_imports_alone(module):
    name = PKG if module == "__init__" else f"{PKG}.{module}"
    heavy = ("torch", "transformers", "httpx", "safetensors", "numpy")
    code = (f"import sys, importlib; importlib.import_module({name!r}); "
            f"print(','.join(sorted({{m.split('.')[0] for m in sys.modules}} & set({heavy!r}))))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    if module in ("__init__", "flags", "launcher", "plugin"):  # what SGLang's environment and engine discovery load
        assert r.stdout.strip() == "", f"{name} pulls in {r.stdout.strip()}"


def test_engine_discovery_finds_the_package():
    mods = engine_modules()
    assert mods["sglang"].__name__ == PKG and callable(mods["sglang"].create) and mods["sglang"].NAME == "sglang"
