"""Released code of other projects, for tests that must agree with it: SGLang's source (read, and
its pure-Python rules executed), SpecForge's and speculators' draft classes (run in a subprocess to
write drafts in their own formats).

SGLang's source comes, in this order, from `EAGLENEST_SGLANG_SRC` (an unpacked sglang-0.5.23
wheel), the SGLang environment `make test` sets up (.venv-sglang, scripts/setup_sglang.sh; or
EAGLENEST_SGLANG_PYTHON's), or its wheel; wheels are fetched with `pip download --no-deps` into the
eaglenest cache and unpacked once.  What none of these provides FAILS the test, saying how to
provide it: a check against another project's code that cannot run is not a pass.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

SGLANG_VERSION = "0.5.23"
SPECFORGE_VERSION = "0.2.0"
SPECULATORS_VERSION = "0.9.0"
# what `import speculators` pulls in beyond torch/transformers/pydantic (its training-data code),
# installed without dependencies next to it; none of it runs when a model is built and saved
# (versions pinned to those the tests were run with)
DATASETS_DEPS = ["datasets==5.1.0", "dill==0.4.1", "multiprocess==0.70.19", "xxhash==4.1.0", "fsspec==2026.9.0", "pandas==3.1.1"]
SPECULATORS_IMPORT_DEPS = ["openai==3.57.0", "sniffio==1.3.1", "jiter==0.19.0", "distro==1.9.0", "loguru==0.7.3",
                           f"hs-connectors=={SPECULATORS_VERSION}", *DATASETS_DEPS]


def _cache() -> Path:
    from eaglenest.models.fetch import cache_root

    return cache_root() / "foreign"


def _pip(*args: str, hint: str) -> None:
    r = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"pip {' '.join(args[:3])} ... failed (PyPI unreachable?): {r.stderr.strip()[-300:]}; {hint}", pytrace=False)


def _installed_source(python: Path, name: str, version: str) -> Path | None:
    """The directory holding package `name` in `python`'s environment, if version `version` is installed there."""
    code = ("import importlib.metadata as md, importlib.util as u, sys; n, v = sys.argv[1:]; s = u.find_spec(n)\n"
            "if s and md.version(n) == v: print(s.submodule_search_locations[0])")
    r = subprocess.run([str(python), "-c", code, name, version], capture_output=True, text=True)
    return Path(r.stdout.strip()).parent if r.returncode == 0 and r.stdout.strip() else None


def unpacked_wheel(name: str, version: str) -> Path:
    """Directory holding the wheel's packages (e.g. `<dir>/sglang/srt/...`)."""
    hint = f"these tests read {name}=={version}'s released source"
    if name == "sglang":
        from sglang_live import sglang_python

        if os.environ.get("EAGLENEST_SGLANG_SRC"):
            return Path(os.environ["EAGLENEST_SGLANG_SRC"])
        if (py := sglang_python()) and (site := _installed_source(py, name, version)):
            return site
        hint += (": `make test` installs it into .venv-sglang (bash scripts/setup_sglang.sh)"
                 + (f", but {py} has no sglang=={version}" if py else ", which is missing")
                 + ", or set EAGLENEST_SGLANG_SRC to an unpacked wheel")
    out = _cache() / f"{name}-{version}"
    if (out / ".complete").exists():
        return out
    dl = _cache() / "downloads"
    dl.mkdir(parents=True, exist_ok=True)
    _pip("download", "--no-deps", "-d", str(dl), f"{name}=={version}", hint=hint)
    whl = next(p for p in dl.glob("*.whl") if p.name.lower().startswith(f"{name.replace('-', '_')}-{version}"))
    with zipfile.ZipFile(whl) as z:
        z.extractall(out)
    (out / ".complete").touch()
    return out


def site_with(name: str, version: str, extra: list[str] = ()) -> Path:
    """A directory for PYTHONPATH with `name==version` and `extra` installed there without dependencies."""
    out = _cache() / f"site-{name}-{version}"
    if (out / ".complete").exists():
        return out
    _pip("install", "--no-deps", "--target", str(out), f"{name}=={version}", *extra,
         hint=f"these tests run {name}=={version}'s released code, installed from PyPI into {out}")
    (out / ".complete").touch()
    return out


def run_python(code: str, *paths: Path, args: list[str] = ()) -> str:
    """Run `code` in a fresh interpreter (this venv's: torch, transformers) with `paths` first on
    sys.path; returns stdout, fails the test with the output on a non-zero exit."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in paths)}
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r.stdout
