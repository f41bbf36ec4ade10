"""Typed stage configs: one dataclass per stage is the single declaration of its options.

A stage declares its config as a dataclass whose fields carry their help text (and, optionally,
choices or a metavar) in `option(...)` metadata; its CLI then needs three lines:

    add_arguments(parser, TrainConfig)            # --flag per field, --config FILE, --print-config
    cfg = from_args(args, TrainConfig)            # defaults < YAML file < flags given on the line
    if args.print_config: print(to_yaml(cfg))

Precedence is by *presence*: the generated flags have no argparse default, so a flag typed on the
command line always wins over the file, even when it repeats the dataclass default (`--lr 1e-4`
beats a YAML `lr: 3e-4`).  Unknown keys, wrong types, values outside `choices` and missing required
options are one-line EaglenestErrors naming the file, line and field.

A `list[T]` field is a repeatable flag (`--engine a --engine b`), or with `nargs="+"` one flag taking
several values (`--data a.jsonl b.jsonl`); in YAML it is a list, and a flag replaces the file's list
(no merging).  `positional=True` makes a field a positional argument (optional on the line, so that
the file may give it).  Every command wires itself the same way: `p.set_defaults(func=Command(Cfg, run))`.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

from eaglenest import EaglenestError

_MISSING = dataclasses.MISSING


def option(default=_MISSING, help: str = "", *, choices=None, metavar: str | None = None, cli: bool = True,
           default_factory=_MISSING, type=None, nargs: str | None = None, positional: bool = False):
    """A dataclass field with its command-line help.  cli=False: settable from the YAML file only.
    choices: a list, or a function returning one (computed when the parser is built: e.g. the engines
    that import).  type: a parser/checker of one value (argparse's `type`), also applied to the
    file's values.  nargs: "+" for a list field given as one flag with several values."""
    meta = {"help": help, "choices": choices, "metavar": metavar, "cli": cli, "type": type, "nargs": nargs,
            "positional": positional}
    if default_factory is not _MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _base_type(tp) -> tuple[type, bool]:
    """(scalar type, whether None is allowed) of an annotation such as `int | None`; a `list[T]`
    comes back as the generic alias itself (see _item_type)."""
    optional = False
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional = len(args) < len(typing.get_args(tp))
        tp = args[0] if len(args) == 1 else str
    if typing.get_origin(tp) is list and typing.get_args(tp):
        return tp, optional
    return (typing.get_origin(tp) or tp), optional


def _item_type(tp):
    """T of a `list[T]` field, else None."""
    return typing.get_args(tp)[0] if typing.get_origin(tp) is list else None


def _fields(cls) -> list[tuple[dataclasses.Field, type, bool]]:
    hints = typing.get_type_hints(cls)
    return [(f, *_base_type(hints[f.name])) for f in dataclasses.fields(cls)]


def _choices(meta):
    c = meta.get("choices")
    return list(c()) if callable(c) else c


def _default(f: dataclasses.Field):
    if f.default is not _MISSING:
        return f.default
    if f.default_factory is not _MISSING:
        return f.default_factory()
    return _MISSING


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _name_on_line(f: dataclasses.Field) -> str:
    return (f.metadata.get("metavar") or f.name.upper()) if f.metadata.get("positional") else flag(f.name)


def add_arguments(parser: argparse.ArgumentParser, cls) -> None:
    """One flag per field of `cls` (no argparse defaults: see the module docstring), plus
    --config FILE and --print-config."""
    for f, tp, optional in _fields(cls):
        meta = f.metadata
        if not meta.get("cli", True):
            continue
        d = _default(f)
        required = d is _MISSING
        help_ = meta.get("help", "")
        if required:
            help_ += " (required: flag or config file)"
        elif "default" not in help_.lower():  # a help text that explains its default keeps its own words
            help_ += f" (default: {d})"
        kw: dict[str, Any] = {"default": argparse.SUPPRESS, "help": help_.replace("%", "%%")}
        item, choices = _item_type(tp), _choices(meta)
        if tp is bool and f.name.startswith("no_"):  # already a negation (--no-baseline): argparse would read
            kw["action"] = "store_true"               # --no-X of BooleanOptionalAction as False
        elif tp is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = meta.get("type") or (item or (_parse_optional(tp) if optional else tp))
            if choices:
                kw["choices"] = choices
            kw["metavar"] = meta.get("metavar") or (None if choices else f.name.upper())
        if meta.get("positional"):  # optional on the line: the config file may give it
            kw["nargs"] = "*" if item else "?"
            parser.add_argument(f.name, **kw)
            continue
        if item and meta.get("nargs"):
            kw["nargs"] = meta["nargs"]
        elif item:
            kw["action"] = "append"
        parser.add_argument(flag(f.name), dest=f.name, **kw)
    parser.add_argument("--config", metavar="FILE.yaml", default=None,
                        help="YAML file setting any of these options by name, with _ for - (`max_new_tokens: 64`); flags given here "
                        "win over it")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved configuration as YAML (defaults < --config file < flags) and exit")


def _parse_optional(tp):
    def parse(s: str):
        return None if s.lower() in ("none", "null") else tp(s)

    parse.__name__ = tp.__name__
    return parse


def _coerce(value, tp, optional: bool, where: str):
    if value is None:
        if optional:
            return None
        raise EaglenestError(f"{where}: null is not allowed here")
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads `1e-4` (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass  # not a number: the type error below names the field and the value
    if tp in (int, str, bool, dict, list) and isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
        return value
    raise EaglenestError(f"{where}: expected {'' if not optional else 'null or '}{tp.__name__}, got {value!r}")


def read_yaml(path: str | Path, cls) -> dict:
    """The options in a YAML file, checked against the fields of `cls` (file:line in every error)."""
    import yaml

    try:
        text = Path(path).read_text()
        node = yaml.compose(text)
        data = yaml.safe_load(text)
    except OSError as e:
        raise EaglenestError(f"{path}: cannot read config ({e.strerror})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise EaglenestError(f"{path}:{mark.line + 1 if mark else '?'}: not valid YAML ({getattr(e, 'problem', e)})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise EaglenestError(f"{path}:1: a config file is a mapping of option: value")
    lines = {k.value: k.start_mark.line + 1 for k, _ in node.value} if isinstance(node, yaml.MappingNode) else {}
    fields = {f.name: (f, tp, optional) for f, tp, optional in _fields(cls)}
    out = {}
    for k, v in data.items():
        key = str(k).replace("-", "_")
        where = f"{path}:{lines.get(k, '?')}: {k}"
        if key not in fields:
            raise EaglenestError(f"{where}: unknown option; valid: {', '.join(sorted(fields))}")
        f, tp, optional = fields[key]
        item = _item_type(tp)
        if item is None:
            out[key] = _check(_coerce(v, tp, optional, where), f.metadata, where)
        elif v is None and optional:
            out[key] = None
        elif not isinstance(v, list):
            raise EaglenestError(f"{where}: expected a list, got {v!r}")
        else:
            out[key] = [_check(_coerce(x, item, False, where), f.metadata, where) for x in v]
    return out


def _check(value, meta, where: str):
    """A file's value through the field's own parser and choices, as the flag's would go."""
    if value is None:
        return value
    if meta.get("type"):
        try:
            value = meta["type"](value)
        except (argparse.ArgumentTypeError, TypeError, ValueError) as e:
            raise EaglenestError(f"{where}: {e}") from None
    choices = _choices(meta)
    if choices and value not in choices:
        raise EaglenestError(f"{where}: {value!r} is not one of {', '.join(map(str, choices))}")
    return value


def from_args(args: argparse.Namespace, cls):
    """defaults < --config file < flags present on the command line."""
    values = read_yaml(args.config, cls) if getattr(args, "config", None) else {}
    names = {f.name for f in dataclasses.fields(cls)}
    values.update({k: v for k, v in vars(args).items() if k in names})
    missing = [_name_on_line(f) for f, _, _ in _fields(cls) if _default(f) is _MISSING and f.name not in values]
    if missing:
        raise EaglenestError(f"missing required option(s) {', '.join(missing)} (on the command line or in --config)")
    return cls(**values)


def to_yaml(cfg) -> str:
    import yaml

    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)


class Command:
    """A subcommand's `func`: resolves `cls` from the parsed line (defaults < --config < flags),
    validates it (`cfg.validate()` where defined), prints it for --print-config, else calls
    `run(cfg, args)`.  The resolved values are also set on `args`, which engines read their
    flags from.  A class, not a closure: `eval --workers` pickles `args` into its processes."""

    def __init__(self, cls, run):
        self.cls, self.run = cls, run

    def resolve(self, args: argparse.Namespace):
        """The command's config from the parsed line, validated, its values also set on `args`."""
        cfg = from_args(args, self.cls)
        if hasattr(cfg, "validate"):
            cfg.validate()
        vars(args).update(dataclasses.asdict(cfg))
        return cfg

    def __call__(self, args: argparse.Namespace) -> int:
        cfg = self.resolve(args)
        if args.print_config:
            print(to_yaml(cfg), end="")
            return 0
        return self.run(cfg, args)


def add_command(sub, cls, run, *args, **kwargs) -> argparse.ArgumentParser:
    """`sub.add_parser(*args, **kwargs)` with one flag per field of `cls`, --config and
    --print-config, and `Command(cls, run)` as its func: how every subcommand is declared."""
    p = sub.add_parser(*args, **kwargs)
    add_arguments(p, cls)
    p.set_defaults(func=Command(cls, run))
    return p

