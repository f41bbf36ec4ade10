"""Engines: what runs the target for capture, regenerate and online training (hf in this process;
vllm and sglang as servers through http.py's one client), behind one narrow interface
(base.Engine).

Public entry: `get_engine_module(NAME).create(args) -> Engine`.  An engine is one module in this
package exposing `NAME`, `add_arguments(parser)` and `create(args)`; adding an engine touches that
one file: the CLI discovers engines by scanning this package."""

from __future__ import annotations

import importlib
import pkgutil

from eaglenest import EaglenestError

_SKIP = {"base"}


def engine_modules(errors: dict | None = None) -> dict:
    """{NAME: module}.  A module that fails to import is left out; its error goes into `errors`
    (by module name) when given, so that asking for it can say why."""
    mods = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name in _SKIP or info.name.startswith("_"):
            continue
        try:
            mod = importlib.import_module(f"{__name__}.{info.name}")
        except ImportError as e:
            if errors is not None:
                errors[info.name] = f"{type(e).__name__}: {e}"
            continue
        if hasattr(mod, "create") and hasattr(mod, "NAME"):
            mods[mod.NAME] = mod
    return mods


def engine_names() -> list[str]:
    """The engines that import here: the choices of every --engine that runs the target."""
    return sorted(engine_modules())


def get_engine_module(name: str):
    errors: dict = {}
    mods = engine_modules(errors)
    if name not in mods:
        why = f"; module {name} does not import: {errors[name]}" if name in errors else ""
        raise EaglenestError(f"unknown engine '{name}' (available: {', '.join(sorted(mods))}){why}")
    return mods[name]


def add_engine_arguments(parser, engines: dict | None = None, shared: tuple[str, ...] = ()) -> None:
    """One argument group per engine (each engine's flags carry its own prefix).  `shared`: flags
    the parser already has with the same meaning for an engine (train's --device is the hf
    engine's device: target and draft on one device); the engine reads the parser's."""
    for name, mod in sorted((engines or engine_modules()).items()):
        if hasattr(mod, "add_arguments"):
            mod.add_arguments(_Without(parser.add_argument_group(f"{name} engine"), shared))


class _Without:
    """An argument group that leaves out the flags in `skip`."""

    def __init__(self, group, skip: tuple[str, ...]):
        self.group, self.skip = group, skip

    def add_argument(self, *flags, **kw):
        return None if any(f in self.skip for f in flags) else self.group.add_argument(*flags, **kw)
