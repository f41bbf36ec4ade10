"""The `eaglenest` command: a thin dispatcher over the stage packages.

Each stage owns its arguments in `<stage>/cli.py` with `register(subparsers)`, which adds a
subparser and sets `func`; this file only wires them together and turns EaglenestError into a
one-line message (exit 2) instead of a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from eaglenest import EaglenestError, __version__
from eaglenest.utils import keep_freed_heap

# (module, description) in pipeline order; a module missing here means the stage is not built yet
STAGES = [
    "eaglenest.models.cli",  # model fetch
    "eaglenest.data.cli",  # prepare
    "eaglenest.capture.cli",  # capture
    "eaglenest.features.cli",  # features verify / info
    "eaglenest.data.regenerate_cli",  # regenerate
    "eaglenest.train.cli",  # train
    "eaglenest.export.cli",  # export, check-draft
    "eaglenest.evaluate.cli",  # eval
    "eaglenest.demo",  # demo
    "eaglenest.engines.sglang.plugin_cli",  # sglang-plugin
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="eaglenest",
        description="Train EAGLE-3 draft models for speculative decoding: "
        "prepare -> capture -> train -> export -> eval (or `eaglenest demo` for all of it on SmolLM2).",
    )
    p.add_argument("--version", action="version", version=f"eaglenest {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for mod_name in STAGES:
        try:
            mod = importlib.import_module(mod_name)
        except ModuleNotFoundError as e:
            if e.name == mod_name:
                continue
            raise
        mod.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        rc = args.func(args)
    except EaglenestError as e:
        print(f"eaglenest {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"eaglenest {args.command}: interrupted (re-run the same command to resume)", file=sys.stderr)
        return 130
    return int(rc or 0)


def run() -> None:
    """The process entry (`eaglenest`, `python -m eaglenest`): the allocator is tuned for the whole
    process here, not in `main`, which tests and the demo also call inside a longer-lived process."""
    keep_freed_heap()  # the same numbers, fewer page faults (utils.keep_freed_heap)
    sys.exit(main())


if __name__ == "__main__":
    run()
