"""`eaglenest prepare`."""

from __future__ import annotations

import argparse

from eaglenest.data.rows import FORMATS
from eaglenest.data.store import DEFAULT_SHARD_SIZE


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show defaults, but not the uninformative ones (required options, unset flags, None)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.required or action.default in (None, False):
            return action.help or ""
        return super()._get_help_string(action) or ""


def register(sub) -> None:
    p = sub.add_parser(
        "prepare",
        help="tokenize conversations into a training data directory",
        description="Render each conversation with the target's own chat template, tokenize it, and mark "
        "the loss mask: exactly what the model generates in every (or, --loss-on last, the last) assistant turn, as the "
        "template renders it (its reasoning, if the template renders one, and its content), plus its end-of-turn token. "
        "Bad items are counted by reason and skipped (or stop the run with --strict). Writes parquet "
        "shards, token_counts.safetensors and meta.json (last) into DATA_DIR.",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--model", required=True, metavar="TARGET",
                   help="target checkpoint directory, or a known name such as smollm2 (its tokenizer and chat template are used)")
    p.add_argument("--data", required=True, nargs="+", metavar="FILE",
                   help="input .json (array) or .jsonl files, optionally .gz; or the built-in ShareGPT set as "
                   "`sharegpt:` (all) or `sharegpt:N` (its first N items)")
    p.add_argument("--out", required=True, metavar="DATA_DIR", help="output directory (previous output there is replaced)")
    p.add_argument("--format", choices=FORMATS, default="auto",
                   help="row format: sharegpt (conversations/from/value), messages (OpenAI role/content), "
                   "tokens (input_ids + loss_mask, used as is); auto detects it per row")
    p.add_argument("--max-length", type=_positive_int, default=2048, metavar="N", help="maximum tokens per sample")
    p.add_argument("--on-overlength", choices=("truncate", "drop"), default="truncate",
                   help="what to do with samples longer than --max-length: keep their first N tokens, or skip them")
    p.add_argument("--strict", action="store_true", help="stop at the first bad item with an error naming file:line")
    p.add_argument("--limit", type=_positive_int, default=None, metavar="N", help="stop after N usable samples (default: all)")
    p.add_argument("--shard-size", type=_positive_int, default=DEFAULT_SHARD_SIZE, metavar="N", help="rows per parquet shard")
    p.add_argument("--loss-on", choices=("all", "last"), default="all",
                   help="assistant turns under the loss: every one, or only the last (recipes for thinking data); "
                   "a turn's reasoning (reasoning_content / thinking) is masked as the template renders it")
    p.add_argument("--trust-remote-code", action="store_true", help="allow custom tokenizer code from the checkpoint")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from eaglenest.data.pipeline import prepare

    prepare(
        model=args.model,
        data=args.data,
        out=args.out,
        format=args.format,
        max_length=args.max_length,
        on_overlength=args.on_overlength,
        strict=args.strict,
        limit=args.limit,
        shard_size=args.shard_size,
        trust_remote_code=args.trust_remote_code,
        loss_on=args.loss_on,
    )
    return 0
