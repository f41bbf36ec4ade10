"""One JSON row -> a chat (list of role/content messages) or a validated pre-tokenized sample.

Bad rows raise `ItemError(reason, message)`; the reasons are the keys of the failure summary:
  wrong_type, missing_field, unknown_role, empty_conversation, no_assistant (also: a token row
  whose loss_mask has no 1), length_mismatch, token_out_of_range, bad_loss_mask, non_utf8 (text
  with a lone surrogate escape).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

FORMATS = ("auto", "sharegpt", "messages", "tokens")

# ShareGPT speaker names and OpenAI roles -> template roles (matched case-insensitively)
ROLE_MAP = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
}


# a JSON `\udXXX` escape can decode to a lone surrogate: valid JSON, but not text a tokenizer takes
_SURROGATE = re.compile("[\ud800-\udfff]")


def clean_id(text: str) -> str:
    """Ids must be valid UTF-8 for parquet: lone surrogates become visible `\\udXXX` escapes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class ItemError(Exception):
    """A bad input item: counted under `reason`, the run goes on (unless --strict)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass
class Row:
    format: str  # sharegpt | messages | tokens
    id: str | None
    messages: list[dict[str, str]] | None = None
    input_ids: list[int] | None = None
    loss_mask: list[int] | None = None


def row_id(value: Any) -> str | None:
    """The row's own id if it has a usable one (a non-empty string or an integer)."""
    if not isinstance(value, dict):
        return None
    rid = value.get("id")
    if isinstance(rid, bool):
        return None
    if isinstance(rid, int):
        return str(rid)
    if isinstance(rid, str) and rid.strip():
        return clean_id(rid)
    return None


def detect_format(value: dict) -> str:
    if "conversations" in value:
        return "sharegpt"
    if "messages" in value:
        return "messages"
    if "input_ids" in value:
        return "tokens"
    keys = ", ".join(sorted(map(str, value))[:8]) or "none"
    raise ItemError("missing_field", f"row has none of 'conversations', 'messages', 'input_ids' (keys: {keys})")


def parse_row(value: Any, fmt: str = "auto") -> Row:
    if not isinstance(value, dict):
        raise ItemError("wrong_type", f"row must be a JSON object, got {_type(value)}")
    if fmt == "auto":
        fmt = detect_format(value)
    rid = row_id(value)
    if fmt == "sharegpt":
        return Row(fmt, rid, messages=_sharegpt_messages(value))
    if fmt == "messages":
        return Row(fmt, rid, messages=_openai_messages(value))
    if fmt == "tokens":
        ids, mask = _token_lists(value)
        return Row(fmt, rid, input_ids=ids, loss_mask=mask)
    raise ValueError(f"unknown format {fmt!r}")


def _type(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def _role(raw: Any, where: str) -> str:
    if not isinstance(raw, str):
        raise ItemError("wrong_type", f"{where}: role must be a string, got {_type(raw)}")
    role = ROLE_MAP.get(raw.strip().lower())
    if role is None:
        raise ItemError("unknown_role", f"{where}: unknown role {raw!r}")
    return role


def _turns(value: dict, key: str) -> list:
    if key not in value:
        raise ItemError("missing_field", f"row has no '{key}' field")
    turns = value[key]
    if not isinstance(turns, list):
        raise ItemError("wrong_type", f"'{key}' must be a list, got {_type(turns)}")
    if not turns:
        raise ItemError("empty_conversation", f"'{key}' is empty")
    return turns


def _sharegpt_messages(value: dict) -> list[dict[str, str]]:
    messages = []
    for i, turn in enumerate(_turns(value, "conversations")):
        where = f"conversations[{i}]"
        if not isinstance(turn, dict):
            raise ItemError("wrong_type", f"{where} must be an object, got {_type(turn)}")
        # some ShareGPT exports use role/content inside conversations: accept both spellings
        role_key = "from" if "from" in turn else "role"
        text_key = "value" if "value" in turn else "content"
        if role_key not in turn or text_key not in turn:
            raise ItemError("missing_field", f"{where} needs 'from' and 'value'")
        content = turn[text_key]
        if not isinstance(content, str):
            raise ItemError("wrong_type", f"{where}.{text_key} must be a string, got {_type(content)}")
        messages.append(_with_reasoning({"role": _role(turn[role_key], where), "content": _text(content, f"{where}.{text_key}")}, turn, where))
    return messages


def _openai_messages(value: dict) -> list[dict[str, str]]:
    messages = []
    for i, msg in enumerate(_turns(value, "messages")):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise ItemError("wrong_type", f"{where} must be an object, got {_type(msg)}")
        if "role" not in msg or "content" not in msg:
            raise ItemError("missing_field", f"{where} needs 'role' and 'content'")
        messages.append(_with_reasoning({"role": _role(msg["role"], where), "content": _text(_content_text(msg["content"], where), where)}, msg, where))
    return messages


# where chat data keeps an assistant turn's reasoning: DeepSeek / Qwen3 / vLLM `reasoning_content`,
# OpenRouter-style `reasoning`, GPT-OSS-style `thinking`; carried as `reasoning_content` (data/chat.py
# hands it to the template under the name the template reads)
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")


def _with_reasoning(message: dict, turn: dict, where: str) -> dict:
    if message["role"] != "assistant":
        return message
    for key in REASONING_KEYS:
        v = turn.get(key)
        if v is None:
            continue
        if not isinstance(v, str):
            raise ItemError("wrong_type", f"{where}.{key} must be a string, got {_type(v)}")
        return {**message, "reasoning_content": _text(v, f"{where}.{key}")}
    return message


def _text(content: str, where: str) -> str:
    if _SURROGATE.search(content):
        raise ItemError("non_utf8", f"{where} contains a lone surrogate escape (\\udXXX): not valid Unicode text")
    return content


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ItemError("wrong_type", f"{where}.content[{j}] is not a {{'type': 'text', 'text': str}} part")
            texts.append(part["text"])
        # joined with a newline, as vLLM does when it serves OpenAI text parts
        return "\n".join(texts)
    raise ItemError("wrong_type", f"{where}.content must be a string or a list of text parts, got {_type(content)}")


def _int_list(value: dict, key: str) -> list[int]:
    if key not in value:
        raise ItemError("missing_field", f"row has no '{key}' field")
    v = value[key]
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise ItemError("wrong_type", f"'{key}' must be a list of integers")
    return v


def _token_lists(value: dict) -> tuple[list[int], list[int]]:
    ids = _int_list(value, "input_ids")
    mask = _int_list(value, "loss_mask")
    if not ids:
        raise ItemError("empty_conversation", "'input_ids' is empty")
    if len(ids) != len(mask):
        raise ItemError("length_mismatch", f"input_ids has {len(ids)} tokens but loss_mask has {len(mask)}")
    if any(m not in (0, 1) for m in mask):
        raise ItemError("bad_loss_mask", "loss_mask values must be 0 or 1")
    if not any(mask):
        raise ItemError("no_assistant", "loss_mask has no 1: nothing to learn")
    return ids, mask


def check_token_range(ids: list[int], vocab_size: int) -> None:
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ItemError("token_out_of_range", f"token id {bad} outside the vocabulary [0, {vocab_size})")
