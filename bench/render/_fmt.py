"""Formatting helpers shared by the render modules (bench/report.py): one way to write a number, a CPU,
a series.  They read fields with r["..."]: a missing field raises, nothing is defaulted."""

from __future__ import annotations


def num(x: float, nd: int = 0) -> str:
    """1234.5 -> '1,234' (nd=0), '1,234.5' (nd=1)."""
    return f"{x:,.{nd}f}"


def cpu(r: dict) -> str:
    """The CPU model alone (a page says which CPU a number comes from)."""
    return r["machine"]["cpu_model"]


def seq(xs, nd: int = 2, sep: str = " / ") -> str:
    return sep.join(f"{x:.{nd}f}" for x in xs)
