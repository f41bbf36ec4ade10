"""`eaglenest prepare`: options are PrepareConfig's fields (eaglenest/data/config.py)."""

from __future__ import annotations

from dataclasses import asdict

from eaglenest.config import add_command


def register(sub) -> None:
    from eaglenest.data.config import PrepareConfig

    add_command(
        sub, PrepareConfig, _run,
        "prepare",
        help="tokenize conversations into a training data directory",
        description="Render each conversation with the target's own chat template, tokenize it, and mark "
        "the loss mask: exactly what the model generates in every (or, --loss-on last, the last) assistant turn, as the "
        "template renders it (its reasoning, if the template renders one, and its content), plus its end-of-turn token. "
        "Bad items are counted by reason and skipped (or stop the run with --strict). Writes parquet "
        "shards, token_counts.safetensors and meta.json (last) into DATA_DIR. Options can come from a YAML file "
        "(--config; flags win).",
    )


def _run(cfg, args) -> int:
    from eaglenest.data.pipeline import prepare

    prepare(**asdict(cfg))
    return 0
