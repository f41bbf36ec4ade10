"""Formatting helpers shared by the render modules (bench/report.py): one way to write a machine, a
number, a ratio.  They read fields with r["..."]: a missing field raises, nothing is defaulted."""

from __future__ import annotations


def num(x: float, nd: int = 0) -> str:
    """1234.5 -> '1,234' (nd=0), '1,234.5' (nd=1)."""
    return f"{x:,.{nd}f}"


def ratio(a: float, b: float, nd: int = 2) -> str:
    """a / b as '1.23x'."""
    return f"{a / b:.{nd}f}x"


def pct(a: float, b: float, nd: int = 1) -> str:
    """(a - b) / b as '+1.2 %'."""
    return f"{100 * (a - b) / b:+.{nd}f} %"


def machine(r: dict) -> str:
    """'Intel(R) Xeon(R) Processor, 2 cores, load 2.1 at start' from a result's `machine`."""
    m = r["machine"]
    return f"{m['cpu_model']}, {m['cpu_count']} cores, load {m['load_average_at_start'][0]:.1f} at start"


def cpu(r: dict) -> str:
    """The CPU model alone (the README says which CPU a number comes from)."""
    return r["machine"]["cpu_model"]


def seq(xs, nd: int = 2, sep: str = " / ") -> str:
    return sep.join(f"{x:.{nd}f}" for x in xs)
