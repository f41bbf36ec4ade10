"""The options of `eaglenest features verify|info|stats|convert|merge`, declared once (their CLIs are
generated from these dataclasses by eaglenest/config.py)."""

from __future__ import annotations

from dataclasses import dataclass

from eaglenest.config import option
from eaglenest.features.store import FP8_BLOCK, STORE_DTYPES

_STORE = "feature store directory"
_OUT = "(created or resumed)"
_IGNORE_DISK = "start even if the size estimate exceeds free space"


@dataclass(kw_only=True)
class InfoConfig:
    store: str = option(help=_STORE, positional=True)


@dataclass(kw_only=True)
class VerifyConfig(InfoConfig):
    repair: bool = option(False, "drop damaged samples from the manifest")


@dataclass(kw_only=True)
class StatsConfig(InfoConfig):
    json: bool = option(False, "print one JSON object instead of a table")


@dataclass(kw_only=True)
class ConvertConfig:
    store: str = option(help="source " + _STORE, positional=True)
    store_dtype: str = option(help="dtype of the new store", choices=sorted(STORE_DTYPES))
    fp8_block: int = option(FP8_BLOCK, "fp8 stores: values per scale, as capture's --fp8-block (0 = one scale per token "
                            f"and layer) (default: {FP8_BLOCK})", metavar="N")
    out: str = option(help=f"new {_STORE} {_OUT}")
    ignore_disk: bool = option(False, _IGNORE_DISK)


@dataclass(kw_only=True)
class MergeConfig:
    stores: list[str] = option(help="feature store directories (two or more)", positional=True)
    out: str = option(help=f"merged {_STORE} {_OUT}")
    on_collision: str = option("error", "one id holding different samples in two stores (prepared ids are `file stem:line`, "
                               "so slices of same-named files collide): error (naming both), skip (keep the first) or "
                               "rename (keep both, the later as <id>~<store number>); identical copies are always kept once",
                               choices=["error", "skip", "rename"])
    ignore_disk: bool = option(False, _IGNORE_DISK)
