"""`eaglenest regenerate --model TARGET --data DATA_DIR --out DATA_DIR2 [--engine vllm|hf]`: options are
RegenerateConfig's fields (eaglenest/data/config.py); the engines' flags are added by eaglenest/engines."""

from __future__ import annotations

import argparse

from eaglenest.config import add_command


def register(sub) -> None:
    from eaglenest.data.config import RegenerateConfig
    from eaglenest.engines import add_engine_arguments

    p = add_command(
        sub, RegenerateConfig, _run,
        "regenerate",
        help="replace assistant turns with the target's own answers",
        description="The EAGLE-3 recipe: rebuild every prepared sample with the target's own answers. For each assistant "
        "turn (a run of the loss mask), the target continues the conversation as it stands -- the original system/user "
        "tokens and its own earlier answers -- and its answer (ending with the end-of-turn token) replaces the data "
        "set's, with the loss mask over exactly the generated tokens. A turn cut by the length limit ends the sample "
        "there (later turns dropped, counted as truncated). Answers that loop (repeated n-grams) or hit the length cap are "
        "counted and can be left out (--drop-loops, --drop-capped). Token-exact (echoed prompt ids are checked) and resumable: "
        "re-run the same command to continue; OUT becomes an ordinary DATA_DIR for `eaglenest capture`. Options can "
        "come from a YAML file (--config; flags win; engine flags only as flags).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--layers", default="auto", help=argparse.SUPPRESS)  # engines read it; nothing is captured here
    add_engine_arguments(p)


def _run(cfg, args) -> int:
    from eaglenest.data import PreparedData
    from eaglenest.data.regenerate import Quality, run_regenerate
    from eaglenest.engines import get_engine_module
    from eaglenest.models.target import resolve_model_path

    data = PreparedData(cfg.data)
    model_path = resolve_model_path(cfg.model)
    engine = get_engine_module(cfg.engine).create(args)  # engines read their flags from args
    with engine:
        s = run_regenerate(
            engine,
            data,
            cfg.out,
            model_path=model_path,
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            seed=cfg.seed,
            max_turns=cfg.max_turns,
            batch_size=cfg.batch_size,
            limit=cfg.limit,
            max_failures=cfg.max_failures,
            quality=Quality(cfg.loop_ngram, cfg.loop_share, cfg.drop_loops, cfg.drop_capped),
        )
    return 0 if s.failed == 0 else 1
