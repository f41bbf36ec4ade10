"""The options of `eaglenest prepare` and `eaglenest regenerate`, declared once (their CLIs are
generated from these dataclasses by eaglenest/config.py)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from eaglenest import EaglenestError
from eaglenest.config import option
from eaglenest.data.rows import FORMATS
from eaglenest.data.store import DEFAULT_SHARD_SIZE
from eaglenest.engines import engine_names


def positive_int(value) -> int:
    try:
        v = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


@dataclass(kw_only=True)
class PrepareConfig:
    model: str = option(help="target checkpoint directory, or a known name such as smollm2 (its tokenizer and chat template are used)",
                        metavar="TARGET")
    data: list[str] = option(help="input .json (array) or .jsonl files, optionally .gz; or the built-in ShareGPT set as "
                             "`sharegpt:` (all) or `sharegpt:N` (its first N items)", metavar="FILE", nargs="+")
    out: str = option(help="output directory (previous output there is replaced)", metavar="DATA_DIR")
    format: str = option("auto", "row format: sharegpt (conversations/from/value), messages (OpenAI role/content), "
                         "tokens (input_ids + loss_mask, used as is); auto detects it per row", choices=list(FORMATS))
    max_length: int = option(2048, "maximum tokens per sample", type=positive_int, metavar="N")
    on_overlength: str = option("truncate", "what to do with samples longer than --max-length: keep their first N tokens, "
                                "or skip them", choices=["truncate", "drop"])
    strict: bool = option(False, "stop at the first bad item with an error naming file:line")
    limit: int | None = option(None, "stop after N usable samples (default: all)", type=positive_int, metavar="N")
    shard_size: int = option(DEFAULT_SHARD_SIZE, "rows per parquet shard", type=positive_int, metavar="N")
    loss_on: str = option("all", "assistant turns under the loss: every one, or only the last (recipes for thinking data); "
                          "a turn's reasoning (reasoning_content / thinking) is masked as the template renders it",
                          choices=["all", "last"])
    trust_remote_code: bool = option(False, "allow custom tokenizer code from the checkpoint")


def _default_engine() -> str:
    """vllm where it imports, else the in-process hf."""
    return "vllm" if "vllm" in engine_names() else "hf"


@dataclass(kw_only=True)
class RegenerateConfig:
    model: str = option(help="target checkpoint directory or known name (smollm2)")
    data: str = option(help="DATA_DIR written by `eaglenest prepare`")
    out: str = option(help="output DATA_DIR (created, or resumed)")
    engine: str = option(help="which engine generates (default: vllm where it imports, else hf)",
                         default_factory=_default_engine, choices=engine_names)
    temperature: float = option(0.7, "sampling temperature (0 = greedy)")
    max_new_tokens: int = option(512, "max tokens generated per assistant turn")
    max_turns: int | None = option(None, "keep only the first N assistant turns of each sample (default: all)")
    seed: int = option(0, "sampling seed")
    batch_size: int = option(32, "samples regenerated (and checkpointed) together")
    limit: int | None = option(None, "only the first N prepared samples")
    max_failures: int | None = option(None, "stop once more samples than this have failed")
    dtype: str = option("bf16", "model dtype", choices=["bf16", "fp32"])
    loop_ngram: int = option(8, "an answer loops when at least --loop-share of its n-grams of this many tokens repeat an "
                             "earlier n-gram of the same answer (a greedy repetition loop); counted, see --drop-loops")
    loop_share: float = option(0.2, "the share of repeated n-grams from which an answer loops (see --loop-ngram)")
    drop_loops: bool = option(False, "leave looping answers out of OUT (counted; the log keeps them: re-running with other "
                              "flags rewrites OUT without generating again)")
    drop_capped: bool = option(False, "leave answers that hit the length cap (--max-new-tokens or the data's max_length) out "
                               "of OUT (counted, as --drop-loops)")

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise EaglenestError("--max-new-tokens must be at least 1")
        if self.loop_ngram < 2 or not 0 < self.loop_share <= 1:
            raise EaglenestError(f"--loop-ngram must be at least 2 and --loop-share in (0, 1] (got {self.loop_ngram}, {self.loop_share})")
        if self.temperature < 0:
            raise EaglenestError("--temperature must be >= 0")
