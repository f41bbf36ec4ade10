"""Small shared helpers: atomic files, hashing, failure accounting, progress bars."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from eaglenest import EaglenestError


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (POSIX needs the directory fsynced too)."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return  # a file system that cannot open directories (e.g. Windows): the rename itself still happened
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path | str) -> None:
    """Flush a file some library wrote (e.g. safetensors' save_file) to disk before it is published."""
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path | str, data: bytes) -> None:
    """Write via temp file + fsync + rename so a kill never leaves a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass  # the temp file is already gone: nothing to clean up; the original error follows
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: Path | str, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def read_json(path: Path | str, what: str = "file") -> Any:
    path = Path(path)
    if not path.exists():
        raise EaglenestError(f"{what} not found: {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise EaglenestError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None


def append_jsonl_durable(path: Path, rows: Iterable[dict]) -> None:
    """Append whole lines and fsync: readers skip a torn last line (see read_jsonl_tolerant)."""
    data = "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows).encode()
    with open(path, "ab") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def read_jsonl_tolerant(path: Path) -> list[dict]:
    """Read a JSONL log written by append_jsonl_durable; a torn final line (kill mid-append) is ignored."""
    if not path.exists():
        return []
    rows = []
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i >= len(lines) - 2:  # only the last (unterminated) line may be torn
                break
            raise EaglenestError(f"{path}:{i + 1}: corrupt manifest line") from None
    return rows


def sha256_bytes(*chunks: bytes) -> str:
    h = hashlib.sha256()
    for c in chunks:
        h.update(c)
    return h.hexdigest()


def sha256_file(path: Path | str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class Failures:
    """Counts and records every skipped or failed item, so nothing is lost silently.

    `strict=True` turns the first recorded failure into an EaglenestError.
    """

    strict: bool = False
    max_examples: int = 50
    counts: Counter = field(default_factory=Counter)
    examples: list[dict] = field(default_factory=list)

    def record(self, reason: str, message: str, *, where: str = "", sample_id: str | None = None) -> None:
        text = f"{where}: {message}" if where else message
        if self.strict:
            raise EaglenestError(text)
        self.counts[reason] += 1
        if len(self.examples) < self.max_examples:
            self.examples.append({"reason": reason, "where": where, "id": sample_id, "message": message})
        from tqdm.auto import tqdm

        tqdm.write(f"warning: {text}", file=sys.stderr)  # through tqdm: keeps a live progress bar intact

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> dict:
        return {"total": self.total, "by_reason": dict(self.counts), "examples": self.examples}

    def format(self, what: str = "samples") -> str:
        if not self.total:
            return f"0 {what} skipped or failed"
        parts = ", ".join(f"{k}: {v}" for k, v in sorted(self.counts.items()))
        return f"{self.total} {what} skipped or failed ({parts})"


def progress(total: int | None = None, desc: str = "", unit: str = "it", **kw):
    """A tqdm bar on stderr (rate and ETA included); quiet when EAGLENEST_NO_PROGRESS is set."""
    from tqdm.auto import tqdm

    disable = bool(os.environ.get("EAGLENEST_NO_PROGRESS"))
    return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, disable=disable, file=sys.stderr, **kw)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def resolve_device(device: str | None) -> str:
    import torch

    if device in (None, "", "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise EaglenestError(f"--device {device} requested but CUDA is not available")
    return device


def release_free_heap() -> None:
    """Give glibc's freed heap back to the OS (malloc_trim).  Variable-sized CPU tensors fragment
    the heap: without it a CPU training run's RSS grows by GBs over a thousand steps.  No-op where
    the C library has no malloc_trim (macOS, musl)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _glibc():
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim, libc.mallopt  # noqa: B018 -- both exist only in glibc
        return libc
    except (OSError, AttributeError):
        return None  # no glibc (macOS, musl): its defaults stay, which costs only speed and resident size


def _malloc_trim():
    libc = _glibc()
    return None if libc is None else libc.malloc_trim


# mallopt parameters (glibc malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4
_MALLOC_ENV = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def keep_freed_heap() -> bool:
    """Let glibc reuse freed memory instead of handing it back to the OS at every free.

    Why: a CPU capture batch, training step or decoding round allocates and frees the same large
    tensors over and over.  glibc serves every block above its mmap threshold (32 MiB at most)
    with a fresh mmap and trims the top of the heap as soon as 2x that is free, so each batch
    faults in and zeroes its pages again (a visible share of a capture's CPU time in a perf profile;
    tests/test_malloc.py counts the page faults).  Here every block comes from the heap and
    the heap is kept (the trainer still trims it every TRIM_EVERY steps, bounding the resident
    size).  Same numbers, only the allocator's bookkeeping changes.  Skipped where the user set
    glibc's own MALLOC_* variables or EAGLENEST_SYSTEM_MALLOC=1, and where the C library is not
    glibc.  Returns whether it applied."""
    if os.environ.get("EAGLENEST_SYSTEM_MALLOC") == "1" or any(k in os.environ for k in _MALLOC_ENV):
        return False
    libc = _glibc()
    if libc is None:
        return False
    return all(libc.mallopt(p, v) == 1 for p, v in ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 1 << 34), (_M_TOP_PAD, 1 << 28)))


def usable_cpu_ids() -> list[int]:
    """Ids of the CPUs this process may run on (its affinity where the OS has one, e.g. not on macOS)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def usable_cpus() -> int:
    """How many CPUs this process may run on (usable_cpu_ids)."""
    return len(usable_cpu_ids())


def cpu_flags() -> str:
    """/proc/cpuinfo's text ('' where there is none, e.g. macOS: no instruction set is assumed)."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_kind() -> str:
    """The CPU's bf16 class, the key of every per-CPU choice and benchmark file: "amx" (Intel AMX tiles:
    torch's bf16 GEMMs run on them), "avx512-bf16" (bf16 dot products, no tiles), "avx2" (bf16
    emulated), or "other"."""
    flags = cpu_flags()
    return ("amx" if "amx_bf16" in flags else "avx512-bf16" if "avx512_bf16" in flags
            else "avx2" if "avx2" in flags else "other")


def cpu_has_fast_bf16() -> bool:
    """True on CPUs with bf16 matrix instructions (Intel AMX or AVX512-BF16): there a bf16 matmul
    runs ~10x faster than fp32 (measured on this project's 2-core Xeon); elsewhere bf16 is emulated
    and slower than fp32 (and without /proc/cpuinfo the safe fp32 choice is made)."""
    return cpu_kind() in ("amx", "avx512-bf16")


def auto_dtype(choice: str, device: str = "auto", engine: str = "hf") -> tuple[str, str]:
    """(dtype, why) a target runs in for `capture --dtype CHOICE` (and the demo's training).  auto =
    bf16, the dtype the engines serve, except for an in-process model on a CPU without bf16 matrix
    instructions (e.g. an AVX2-only AMD EPYC or laptop): there torch emulates bf16 matmuls and a
    SmolLM2 prefill runs ~6x faster in fp32 (git show 0c8d13e:bench/results/target_dtype_cpu_no-bf16.json).  Batch-1
    decoding reads weights rather than multiplying, and bf16 stays faster there, so eval keeps bf16.
    Server engines keep bf16."""
    if choice != "auto":
        return choice, f"--dtype {choice}"
    if engine != "hf" or resolve_device(device) != "cpu":
        return "bf16", "auto: bf16"
    if cpu_has_fast_bf16():
        return "bf16", "auto: bf16 (this CPU has bf16 matrix instructions)"
    return "fp32", "auto: fp32, this CPU has no bf16 matrix instructions (AMX / AVX512-BF16), where bf16 runs several times slower"


def machine_info() -> dict:
    """Where a measurement ran: platform, CPU or GPU model, versions, load (for reports and benchmarks)."""
    import platform

    import torch

    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass  # the record simply has no transformers version
    if torch.cuda.is_available():
        info["device"] = info["gpu"] = torch.cuda.get_device_name(0)
    else:
        info["device"] = "cpu"
        try:
            for line in open("/proc/cpuinfo"):
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass  # no /proc/cpuinfo: the record has no cpu_model (platform/processor still say what ran)
    try:
        info["load_average_at_start"] = os.getloadavg()  # other jobs on the machine skew CPU timings
    except OSError:
        pass  # load average not available on this OS: the record leaves it out
    return info
