"""What tests need to know about this machine: its CPU's flags, read from /proc/cpuinfo (never a
model string, never a list of CPU kinds), and the one rule for tests that rely on exact
verification: they run wherever the set-up probe (evaluate/verification.py `prepare`, the probe eval
runs) finds verification bit-identical to plain decoding, and skip, with the probe's reason, only
where it does not.  A product that broke exactness everywhere cannot hide behind those skips: that
the probe's own remedy makes a batch-dependent kernel exact is asserted on every CPU
(test_verification.py), and the gemv kernel's verification wherever it runs (test_rowwise_linears.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The first processor's flags in /proc/cpuinfo (or in `cpuinfo`); empty where there is none.
    Read here, not by eaglenest: a test of eaglenest's CPU choices must not borrow its reader."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def bf16_matrix_cpu(cpuinfo: str | None = None) -> bool:
    """AMX-BF16 or AVX512-BF16: bf16 matrix instructions (capture --dtype auto keeps bf16 there)."""
    return bool(cpu_flags(cpuinfo) & {"amx_bf16", "avx512_bf16"})


def amx_cpu(cpuinfo: str | None = None) -> bool:
    return "amx_tile" in cpu_flags(cpuinfo)


def gemv_cpu(cpuinfo: str | None = None) -> bool:
    """An instruction set the gemv kernel has a build for (AVX512-BF16, or AVX2 + FMA)."""
    f = cpu_flags(cpuinfo)
    return "avx512_bf16" in f or {"avx2", "fma"} <= f


def require_exact(verification: dict) -> None:
    """Skip, with the probe's reason, where the set-up probe found verification not bit-identical."""
    if verification["exact"]:
        return
    ends = (verification.get("probe_result") or {}).get("end_to_end") or [{}]
    pytest.skip(f"the set-up probe finds verification not bit-identical to plain decoding on this machine: "
                f"{ends[-1].get('first_difference')}")
