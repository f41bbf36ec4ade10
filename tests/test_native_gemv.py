"""The row-invariant bf16 matrix-vector kernel (native/gemv.py): a Linear, row-invariant, and built
only as and where it should be (a private cache, each binary checked against its build record, $CC).

On x86-64 Linux with a C compiler, on any CPU with AVX512-BF16 or AVX2 + FMA (its second build: an
AVX2-only AMD EPYC, most laptops), the kernel must build and run; elsewhere these tests skip, saying
why.  Row-invariance is asserted bit for bit: the kernel promises it by construction (one fixed
instruction sequence per output), unlike a library GEMM."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from cpu_kind import gemv_cpu

from eaglenest import EaglenestError
from eaglenest.native import gemv

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def kernel():
    import platform
    import shutil

    lib, why = gemv.load()
    if lib is None:
        linux_x86 = platform.system() == "Linux" and platform.machine() == "x86_64"
        if gemv_cpu() and linux_x86 and (shutil.which("cc") or shutil.which("gcc")):
            pytest.fail(f"the gemv kernel must run on x86-64 Linux with AVX512-BF16 or AVX2 + FMA and a C compiler: {why}")
        pytest.skip(f"gemv kernel unavailable here: {why}")
    return lib


# (N, K, bias): SmolLM2's shapes, Qwen-style biases, K not a multiple of 32 (masked tail), N not of 4
SHAPES = [(576, 576, False), (192, 576, True), (1536, 576, False), (576, 1536, False), (7, 100, True), (33, 1000, False)]


@pytest.mark.parametrize("n,k,bias", SHAPES)
def test_kernel_is_a_linear_and_row_invariant(kernel, n, k, bias):
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    for m in (1, 2, 3, 4, 5, 9):
        x = torch.randn(1, m, k, generator=g).bfloat16()
        y = gemv.linear(x, w, b)
        assert y.shape == (1, m, n) and y.dtype == torch.bfloat16
        ref = F.linear(x.double(), w.double(), None if b is None else b.double())
        # bf16 output rounding (2^-9 relative) plus fp32 accumulation: far below an indexing bug's O(1)
        assert float((y.double() - ref).abs().max() / ref.abs().max()) < 1e-2
        one_by_one = torch.cat([gemv.linear(x[:, i : i + 1], w, b) for i in range(m)], dim=1)
        assert torch.equal(y, one_by_one), f"{m} rows differ from {m} one-row calls"
        torch.set_num_threads(2)
        try:
            assert torch.equal(gemv.linear(x, w, b), y), "the thread count changed an output"
        finally:
            torch.set_num_threads(1)


def test_kernel_refuses_what_it_cannot_compute(kernel):
    w = torch.randn(8, 64).bfloat16()
    with pytest.raises(ValueError, match="bf16 CPU"):
        gemv.linear(torch.randn(1, 64), w)
    with pytest.raises(ValueError, match="features"):
        gemv.linear(torch.randn(1, 32).bfloat16(), w)


def test_the_kernels_source_is_read_from_the_package_and_shipped_with_it():
    """gemv.c beside gemv.py is what the build compiles, and a wheel carries it (pyproject's package-data)."""
    import fnmatch

    tomllib = pytest.importorskip("tomllib")
    src = Path(gemv.__file__).with_name("gemv.c")
    assert gemv.SOURCE == src.read_text() and "eaglenest_gemv_bf16" in gemv.SOURCE
    root = Path(gemv.__file__).parents[2]
    shipped = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["eaglenest.native"]
    assert all(any(fnmatch.fnmatch(f.name, pat) for pat in shipped) for f in src.parent.iterdir() if f.suffix in (".c", ".h"))


def _script(path, body: str):
    """An executable shell script at `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def own_cache(kernel, tmp_path, monkeypatch):
    """A fresh EAGLENEST_CACHE, the default compiler, nothing loaded yet: its kernels directory."""
    monkeypatch.setenv("EAGLENEST_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("CC", raising=False)
    gemv.load.cache_clear()
    yield tmp_path / "cache" / "kernels"
    gemv.load.cache_clear()


def _built(d):
    (record,) = d.glob("*.json")
    rec = json.loads(record.read_text())
    return d / rec["file"], rec


def test_the_kernel_cache_is_private_and_a_binary_is_loaded_only_as_built(own_cache, tmp_path, monkeypatch, capsys):
    import os
    import subprocess
    import sys

    from eaglenest.utils import sha256_file

    # built in another process: dlopen would hand this one a library it loaded before by the same name
    subprocess.run([sys.executable, "-c", "from eaglenest.native import gemv; assert gemv.load()[0] is not None"], check=True)
    st = own_cache.stat()
    assert st.st_mode & 0o777 == 0o700 and st.st_uid == os.getuid()
    lib, rec = _built(own_cache)
    assert sha256_file(lib) == rec["sha256"] and rec["sha256"][:16] in lib.name
    # another library in its place (what another user of a shared cache could have put there): not loaded
    marker = tmp_path / "constructor-ran"
    src = tmp_path / "evil.c"
    src.write_text('#include <stdio.h>\n__attribute__((constructor)) static void run(void) '
                   f'{{ FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\n')
    subprocess.run([gemv._compiler()[0][0], "-shared", "-fPIC", str(src), "-o", str(lib)], check=True)
    gemv.load.cache_clear()
    capsys.readouterr()
    assert gemv.load()[0] is not None and not marker.exists()
    assert f"{lib}: sha256" in capsys.readouterr().err and sha256_file(lib) == rec["sha256"]  # rebuilt
    x, w = torch.randn(1, 3, 64).bfloat16(), torch.randn(8, 64).bfloat16()
    assert torch.equal(gemv.linear(x, w), torch.cat([gemv.linear(x[:, i : i + 1], w) for i in range(3)], 1))
    # a cache others could write to, or that another user owns, is refused; one they could only read is tightened
    own_cache.chmod(0o775)
    gemv.load.cache_clear()
    with pytest.raises(EaglenestError, match=f"{own_cache}: .*writable by other users"):
        gemv.load()
    own_cache.chmod(0o755)
    gemv.load.cache_clear()
    assert gemv.load()[0] is not None and own_cache.stat().st_mode & 0o777 == 0o700
    uid = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: uid + 1)
    gemv.load.cache_clear()
    with pytest.raises(EaglenestError, match=f"{own_cache}: .*belongs to uid {uid}"):
        gemv.load()


def test_cc_is_split_like_a_shell_and_a_cc_that_fails_is_an_error(own_cache, tmp_path, monkeypatch):
    """CC="ccache gcc" (a wrapper and its compiler): built with the wrapper, never silently without it."""
    log = tmp_path / "wrapper.log"
    wrap = _script(tmp_path / "bin" / "wrap", f'echo "$@" >> "{log}"; exec "$@"')
    cc = gemv._compiler()[0][0]
    monkeypatch.setenv("CC", f"{wrap} {cc}")
    assert gemv.load()[0] is not None
    assert any(" -o " in line and "-fPIC" in line for line in log.read_text().splitlines())
    assert json.loads(next(own_cache.glob("*.json")).read_text())["compiler"] == f"{wrap} {cc}"
    for bad, why in ((f"no-such-wrapper {cc}", "'no-such-wrapper' is not an executable"),
                     (f"{_script(tmp_path / 'bin' / 'broken', 'echo nope >&2; exit 3')} {cc}", "exit 3")):
        monkeypatch.setenv("CC", bad)
        gemv.load.cache_clear()
        with pytest.raises(EaglenestError, match=f"\\$CC='{bad}'.*{why}"):
            gemv.load()


def test_a_compiler_that_hangs_is_stopped_with_its_children(own_cache, tmp_path, monkeypatch):
    """COMPILE_TIMEOUT_S: the compile is killed with its process group (a driver's children too)."""
    import os

    pidfile = tmp_path / "child.pid"
    hang = _script(tmp_path / "bin" / "hang", 'case " $* " in *" --version "*) exec "$@";; esac\n'
                   f'sleep 3600 </dev/null >/dev/null 2>&1 & echo $! > "{pidfile}"; wait')
    monkeypatch.setenv("CC", f"{hang} {gemv._compiler()[0][0]}")
    monkeypatch.setattr(gemv, "COMPILE_TIMEOUT_S", 2)
    with pytest.raises(EaglenestError, match="did not finish within 2 s"):
        gemv.load()
    child = int(pidfile.read_text())

    def alive() -> bool:
        try:
            return Path(f"/proc/{child}/stat").read_text().split(") ")[1][0] not in "ZX"
        except (FileNotFoundError, IndexError):
            return False

    for _ in range(1000):  # SIGKILL is delivered asynchronously: a moment, not a measurement
        if not alive():
            break
        time.sleep(0.01)
    else:
        os.kill(child, 9)
        pytest.fail(f"the compiler's child {child} outlived the timeout")
