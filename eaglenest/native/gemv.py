"""A row-invariant bf16 matrix-vector kernel for batch-1 decoding on a CPU (AVX512-BF16, or AVX2 + FMA).

Why: batch-1 decoding of a small target is bound by its Linear layers reading their weights, and
torch's bf16 `F.linear` (oneDNN) reads them well under what one core can stream, for one row
especially (git show afe579c:bench/results/eval_gemv_cpu.json).  Its batched calls are not promised to be
row-invariant either (evaluate/verification.py).  This kernel is both: every output y[m, n] is the
same sequence of `vdpbf16ps` over K (32 products per instruction, 16 fp32 lanes), the same fixed
reduction of the lanes, plus the bias, rounded once to bf16 -- whatever the number of rows M or
threads, so a k-row verification forward computes each row exactly as a one-row plain decoding
forward does.  Rows are processed 4 at a time against 4 weight rows (the weights are read once per
call), with a software prefetch of the next 4 weight rows.  CPUs without AVX512-BF16 (AVX2-only AMD
EPYCs, most laptops, where torch emulates bf16 matmuls) get a second build of the same source: bf16
widened to fp32 exactly, fused multiply-adds, 2 rows x 4 weight rows at a time (one row: x 8);
row-invariant the same way, rounded differently.

Its source, gemv.c beside this file, is compiled at first use with the system's C compiler (`$CC`,
split as a shell would: "ccache gcc" works; a `$CC` that cannot build it is an error, never a silent
fallback) into the eaglenest cache, with a time limit (COMPILE_TIMEOUT_S).  The cache is private
(0700, this user's: a library loaded from it runs as this user), each binary is named by its own
sha256, and the record of a build (source, flags and compiler -> binary and sha256) is checked
against the file before ctypes loads it; a binary that does not match is not loaded, but rebuilt.
Renames are atomic, so parallel eval workers may race.  The call releases the GIL.  OpenMP threads
come from torch's own libgomp (already loaded, same soname): one thread pool.  Where it cannot be
used (neither ISA, no compiler, not x86-64 Linux) `load()` says why and the caller keeps `F.linear`.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from eaglenest import EaglenestError
from eaglenest.utils import atomic_write_json, sha256_file

# Two builds of one source: AVX512-BF16 (vdpbf16ps) where the CPU has it, else AVX2 + FMA (bf16 widened
# to fp32 exactly, products exact in fp32).  Each is row-invariant; the two round differently.
COMMON = ["-O3", "-fopenmp", "-shared", "-fPIC"]
COMPILE_TIMEOUT_S = 300  # a hung compiler (or a wrapper waiting on a lock) must not hang eval
ISA_FLAGS = {"avx512-bf16": ["-mavx512f", "-mavx512bw", "-mavx512bf16"], "avx2": ["-mavx2", "-mfma"]}

SOURCE = (Path(__file__).parent / "gemv.c").read_text()  # read by the build; its text is part of the cache key


@functools.cache
def isa() -> str | None:
    """Which build this CPU runs ('avx512-bf16', 'avx2') or None (read once per process)."""
    from eaglenest.utils import cpu_flags

    flags = set(cpu_flags().split())
    if "avx512_bf16" in flags:
        return "avx512-bf16"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return None


def _compiler() -> tuple[list[str], bool]:
    """(the C compiler's argv, whether `$CC` named it); ([], False) where there is none."""
    env = os.environ.get("CC", "").strip()
    if env:
        try:
            argv = shlex.split(env)
        except ValueError as e:
            raise EaglenestError(f"$CC={env!r}: not a command line ({e})") from None
        if not shutil.which(argv[0]):
            raise EaglenestError(f"$CC={env!r}: {argv[0]!r} is not an executable on PATH (the gemv kernel is built with $CC)")
        return argv, True
    cc = shutil.which("cc") or shutil.which("gcc")
    return ([cc] if cc else []), False


def _run(argv: list[str]) -> str:
    """argv's stdout; OSError on a non-zero exit, or after COMPILE_TIMEOUT_S (the whole process group
    killed: a compiler driver's children would otherwise keep its pipes, and this call, open)."""
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True) as p:
        try:
            out, err = p.communicate(timeout=COMPILE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
            raise OSError(f"{shlex.join(argv)} did not finish within {COMPILE_TIMEOUT_S} s (killed)") from None
    if p.returncode != 0:
        raise OSError(f"{shlex.join(argv)} failed (exit {p.returncode}): {err.strip()[-500:]}")
    return out


def _private_dir(d: Path) -> Path:
    """`d` created 0700; refused when another user owns it or others may write to it (a library
    there could be anyone's); tightened to 0700 where others may only read it (caches before this)."""
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = d.stat()
    if st.st_uid != os.getuid():
        raise EaglenestError(f"{d}: the gemv kernel cache belongs to uid {st.st_uid}, not to this user (uid {os.getuid()}); "
                             "a cache of shared libraries must be private: set EAGLENEST_CACHE to a directory of your own")
    if st.st_mode & 0o022:
        raise EaglenestError(f"{d}: the gemv kernel cache is writable by other users (mode {st.st_mode & 0o777:o}), so its "
                             "libraries cannot be trusted: remove the directory (eaglenest recreates it private)")
    if st.st_mode & 0o077:
        d.chmod(0o700)
    return d


def _verified(record: Path) -> Path | None:
    """The binary `record` names, if its sha256 is the one recorded at build; None: build it (again)."""
    try:
        rec = json.loads(record.read_text())
        lib = record.parent / Path(rec["file"]).name
        digest = sha256_file(lib)
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as e:
        print(f"warning: {record}: unreadable build record ({e}); rebuilding the gemv kernel", file=sys.stderr)
        return None
    if digest != rec["sha256"]:
        print(f"warning: {lib}: sha256 {digest[:16]}... is not the {str(rec['sha256'])[:16]}... recorded when it was built: "
              "not loaded; rebuilding the gemv kernel", file=sys.stderr)
        return None
    return lib


def _build(cc: list[str], flags: list[str], record: Path) -> None:
    """Compile the kernel, store it under its own sha256, then write `record` (both atomic renames)."""
    with tempfile.TemporaryDirectory(dir=record.parent) as tmp:
        src, lib = Path(tmp) / "gemv.c", Path(tmp) / "gemv.so"
        src.write_text(SOURCE)
        _run([*cc, *flags, str(src), "-o", str(lib)])
        digest = sha256_file(lib)
        name = f"{record.stem}-{digest[:16]}.so"
        os.replace(lib, record.parent / name)
    atomic_write_json(record, {"file": name, "sha256": digest, "compiler": shlex.join(cc), "flags": flags})


@functools.cache
def load() -> tuple[ctypes.CDLL | None, str]:
    """(the kernel's library, '') or (None, why it cannot be used here).  A `$CC` that cannot build
    it, and a kernel cache that is not private, are errors (EaglenestError), not a why."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None, f"not x86-64 Linux ({platform.system()} {platform.machine()})"
    kind = isa()
    if kind is None:
        return None, "this CPU has neither AVX512-BF16 nor AVX2 + FMA"
    flags = [*ISA_FLAGS[kind], *COMMON]
    cc, named = _compiler()
    if not cc:
        return None, "no C compiler (cc/gcc, or $CC)"
    from eaglenest.models.fetch import cache_root

    try:
        version = _run([*cc, "--version"]).splitlines()[:1]
        key = hashlib.sha256("\n".join([SOURCE, *flags, shlex.join(cc), *version]).encode()).hexdigest()[:16]
        record = _private_dir(cache_root() / "kernels") / f"gemv-{kind}-{key}.json"
        path = _verified(record)
        if path is None:
            _build(cc, flags, record)
            path = _verified(record)
        if path is None:
            raise OSError(f"{record}: the binary just built does not match its record")
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        if named:
            raise EaglenestError(f"$CC={os.environ['CC']!r} could not build or load the gemv kernel: {e}") from None
        print(f"warning: the gemv kernel could not be built or loaded ({e}); torch's F.linear is used instead",
              file=sys.stderr)
        return None, f"could not build or load the kernel: {e}"
    fn = lib.eaglenest_gemv_bf16
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
    fn.restype = None
    return lib, ""


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for bf16 CPU tensors through the kernel (which `load()` must have found usable)."""
    lib, why = load()
    if lib is None:
        raise RuntimeError(f"eaglenest gemv kernel unavailable: {why}")
    K = x.shape[-1]
    N = weight.shape[0]
    M = x.numel() // K if K else 0
    if weight.dtype != torch.bfloat16 or x.dtype != torch.bfloat16 or x.device.type != "cpu":
        raise ValueError(f"gemv.linear takes bf16 CPU tensors (got {x.dtype} x {weight.dtype} on {x.device})")
    if weight.shape[1] != K:
        raise ValueError(f"gemv.linear: x has {K} features, the weight {tuple(weight.shape)}")
    x2 = x.reshape(M, K).contiguous()
    w = weight.contiguous()
    b = None if bias is None else bias.to(torch.bfloat16).contiguous()
    y = torch.empty(*x.shape[:-1], N, dtype=torch.bfloat16)
    if M:
        lib.eaglenest_gemv_bf16(x2.data_ptr(), w.data_ptr(), None if b is None else b.data_ptr(), y.data_ptr(),
                                M, N, K, torch.get_num_threads())
    return y

