"""`eaglenest eval --model TARGET --draft DRAFT_DIR --out REPORT.json`: options are EvalConfig's fields
(eaglenest/evaluate/config.py); each engine evaluator adds its own flags."""

from __future__ import annotations

import argparse

from eaglenest.config import add_command


def register(sub) -> None:
    from eaglenest.evaluate.config import EvalConfig

    p = add_command(
        sub, EvalConfig, _run,
        "eval",
        help="measure acceptance length (tau) and speedup of a draft",
        description="Speculative decoding with an EAGLE-3 draft over the target, batch size 1: reports tau "
        "(tokens per target verification step, bonus included; an always-wrong draft gives 1.0), the "
        "acceptance rate per draft position, tokens/s against plain decoding of the same target in the same "
        "dtype, and (at temperature 0) whether the outputs are token-identical to plain greedy decoding. "
        "Options can come from a YAML file (--config; flags win; engine evaluator flags only as flags).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_evaluator_arguments(p)


def _add_evaluator_arguments(p) -> None:
    """The flags an engine evaluator module (`evaluate/engine_<name>.py`) declares with `add_arguments`
    (those modules import nothing heavy at module level)."""
    import importlib
    import pkgutil
    from pathlib import Path

    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if info.name.startswith("engine_"):
            mod = importlib.import_module(f"{__package__}.{info.name}")
            if hasattr(mod, "add_arguments"):
                mod.add_arguments(p.add_argument_group(f"{info.name[len('engine_'):]} evaluator"))


def _engine_args(pairs: list[str]) -> dict[str, str]:
    from eaglenest import EaglenestError

    out = {}
    for kv in pairs:
        if "=" not in kv:
            raise EaglenestError(f"--engine-arg wants KEY=VALUE (got {kv!r})")
        k, v = kv.split("=", 1)
        out[k.strip()] = v
    return out


def _run(cfg, args) -> int:
    from eaglenest.evaluate.run import main_eval

    args.engine_args = _engine_args(cfg.engine_arg)
    return main_eval(args)


def eval_args(argv: list[str]) -> argparse.Namespace:
    """The arguments `eaglenest eval ARGV` hands the evaluator (evaluate.run.evaluate), resolved as the
    command resolves them (defaults < --config < flags, --engine-arg pairs parsed), without running it:
    for callers that drive `evaluate` themselves and must not keep a twin of its options."""
    from eaglenest.cli import build_parser

    args = build_parser().parse_args(["eval", *argv])
    cfg = args.func.resolve(args)
    args.engine_args = _engine_args(cfg.engine_arg)
    return args
