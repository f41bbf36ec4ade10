"""Which of CI's CPU kinds this machine is, read from /proc/cpuinfo's flags (never a model string):
CI runs on Intel Xeons with AMX and on AMD EPYCs with AVX-512 BF16 and no AMX, and sessions have
also been given AMD EPYCs with AVX2 and no AVX-512 at all (Zen 3), so CI may be too.  On those, the
greedy-exactness probe is expected to pass (it did on each, the AVX2 one with the gemv kernel's AVX2
build), so a test that relies on it fails there instead of skipping; anywhere else (another CPU, no
/proc) it may skip, saying why."""

from __future__ import annotations

from pathlib import Path

CI_KINDS = ("intel-amx", "amd-avx512-bf16", "amd-avx2")


def _first_processor(cpuinfo: str | None) -> dict[str, str] | None:
    """The first processor's fields of /proc/cpuinfo (or of `cpuinfo`); None where there is none."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_kind(cpuinfo: str | None = None) -> str | None:
    """'intel-amx', 'amd-avx512-bf16', 'amd-avx2' or None (not a CI kind, or unknown)."""
    fields = _first_processor(cpuinfo)
    if fields is None:
        return None
    flags = set(fields.get("flags", "").split())
    if "amx_tile" in flags:
        return "intel-amx"
    if fields.get("vendor_id") == "AuthenticAMD" and "avx512_bf16" in flags:
        return "amd-avx512-bf16"
    if fields.get("vendor_id") == "AuthenticAMD" and {"avx2", "fma"} <= flags and "avx512f" not in flags:
        return "amd-avx2"
    return None


def bf16_matrix_cpu(cpuinfo: str | None = None) -> bool:
    """Whether the first processor lists AMX-BF16 or AVX512-BF16 (read here, not by eaglenest: a test of
    eaglenest's dtype choice must not borrow its reader)."""
    fields = _first_processor(cpuinfo) or {}
    return bool(set(fields.get("flags", "").split()) & {"amx_bf16", "avx512_bf16"})


def require_exact_on_ci_cpus(verification: dict, kind: str | None = None) -> None:
    """A report's `verification` block must say exact on a CI CPU kind (elsewhere it may not)."""
    kind = cpu_kind() if kind is None else kind
    if kind and not verification["exact"]:
        ends = verification.get("probe_result", {}).get("end_to_end") or [{}]
        raise AssertionError(f"verification is not bit-identical on a {kind} CPU (one CI runs on), where it must be: "
                             f"{ends[-1].get('first_difference')}")
