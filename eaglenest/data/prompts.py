"""A sample's prompt and when two prompts are the same one: the key that the train/held-out split
(train/data.py) and regenerate's duplicate count go by.

The prompt is the sample's tokens before its first loss-masked token (system + first user turn +
the assistant header; the whole sample when nothing is masked).  Its key is the sha256 of its
normalized text: decoded with the target's tokenizer (special tokens kept), Unicode NFKC, case-
folded, every run of whitespace one space, stripped -- so the same question asked twice with
other spacing or capitals is one prompt.  Without a tokenizer the key is the hash of the ids.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Sequence

_SPACE = re.compile(r"\s+")


def prompt_ids(input_ids: Sequence[int], loss_mask: Sequence[int]) -> list[int]:
    ids, mask = list(input_ids), list(loss_mask)
    first = next((i for i, m in enumerate(mask) if m), len(ids))
    return [int(t) for t in ids[:first]]


def normalize_prompt(text: str) -> str:
    return _SPACE.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()


def prompt_key(ids: Sequence[int], tokenizer=None) -> str:
    """The prompt's key (hex sha256), see the module docstring."""
    if tokenizer is None:
        return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()
    text = normalize_prompt(tokenizer.decode(list(ids), skip_special_tokens=False))
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def key_fraction(key: str) -> float:
    """The key as a number in [0, 1): a sample is held out when it is below the held-out share."""
    return int(key[:16], 16) / 2**64
