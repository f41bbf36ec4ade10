"""Token ids and the loss mask of a conversation, derived from the target's own chat template.

The mask covers exactly each assistant message's content plus the one token the template puts
right after it (its end-of-turn token: `<|im_end|>`, `<|eot_id|>`, ...), nothing else.

How the content is located without any per-model strings:
  1. render the conversation as is (`full`), and once more with every assistant content replaced
     by a unique alphanumeric sentinel (`skeleton`);
  2. walk the skeleton: the text between sentinels is the template's own glue (headers, system
     prompt, user turns). `full` must be exactly glue + content + glue + content + ... + glue,
     where each content is the message verbatim or, for templates that trim it, stripped.
     Anything else (a template that drops or rewrites content, e.g. removes <think> blocks) is a
     `template_mismatch`: we never guess;
  3. tokenize `full` with offsets and mask every token that overlaps a content span, plus the
     token that starts exactly where the content ends (the end-of-turn token).
"""

from __future__ import annotations

import secrets
from collections import Counter
from collections.abc import Mapping
from typing import Any

from eaglenest import EaglenestError
from eaglenest.data.rows import ItemError

# compare against apply_chat_template(tokenize=True) for the first few conversations: cheap
# insurance that our render+tokenize path gives the ids the model sees at serving time
_N_REFERENCE_CHECKS = 3


class ChatEncoder:
    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "is_fast", False):
            raise EaglenestError("prepare needs a fast (Rust) tokenizer: the loss mask uses offset mappings")
        if not getattr(tokenizer, "chat_template", None):
            raise EaglenestError("the target tokenizer has no chat template")
        self.tok = tokenizer
        self._nonce = secrets.token_hex(6)
        self._bos_id = tokenizer.bos_token_id
        self._reference_checks = 0
        # end-of-turn token -> how many assistant turns it closed (reported in meta notes)
        self.end_of_turn_tokens: Counter[str] = Counter()

    def render(self, messages: list[dict[str, str]]) -> str:
        try:
            text = self.tok.apply_chat_template(messages, tokenize=False)
        except Exception as e:  # jinja raise_exception(), role-alternation checks, ...
            raise ItemError("template_error", f"chat template failed: {type(e).__name__}: {e}") from None
        if not isinstance(text, str):
            raise ItemError("template_error", f"chat template returned {type(text).__name__}, not text")
        return text

    def encode(self, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
        """Token ids of the rendered conversation and its 0/1 loss mask."""
        if not messages:
            raise ItemError("empty_conversation", "conversation has no messages")
        # whitespace-only assistant turns stay in the text but teach nothing: not masked
        targets = [i for i, m in enumerate(messages) if m["role"] == "assistant" and m["content"].strip()]
        if not targets:
            raise ItemError("no_assistant", "conversation has no assistant turn with content")

        full = self.render(messages)
        spans = self._content_spans(messages, targets, full)

        enc = self.tok(full, add_special_tokens=False, return_offsets_mapping=True)
        ids: list[int] = list(enc["input_ids"])
        offsets: list[tuple[int, int]] = [tuple(o) for o in enc["offset_mapping"]]
        if self._bos_id is not None and len(ids) >= 2 and ids[0] == ids[1] == self._bos_id:
            raise ItemError("template_mismatch", "rendered conversation starts with two BOS tokens")
        if self._reference_checks < _N_REFERENCE_CHECKS:
            self._check_reference(messages, ids)
        return ids, self._mask(ids, offsets, spans)

    def _sentinel(self, i: int) -> str:
        return f"EAGLENEST{self._nonce}SENTINEL{i}END"

    def _content_spans(self, messages: list[dict[str, str]], targets: list[int], full: str) -> list[tuple[int, int]]:
        """Character span of each target assistant content inside `full` (see module docstring)."""
        sentinels = {i: self._sentinel(i) for i in targets}
        if any(self._nonce in m["content"] for m in messages):  # astronomically unlikely
            raise ItemError("template_mismatch", "message content contains the sentinel marker")
        skeleton = self.render(
            [{**m, "content": sentinels[i]} if i in sentinels else m for i, m in enumerate(messages)]
        )
        # positions of the sentinels, which must each appear once and in message order
        marks: list[tuple[int, int]] = []  # (index in messages, start in skeleton)
        prev_end = 0
        for i in targets:
            s = sentinels[i]
            k = skeleton.find(s, prev_end)
            if k < 0 or skeleton.count(s) != 1:
                raise ItemError(
                    "template_mismatch", f"the template does not render assistant message {i} exactly once, in order"
                )
            marks.append((i, k))
            prev_end = k + len(s)

        spans: list[tuple[int, int]] = []
        pos_full = 0
        pos_skel = 0
        for n, (i, k) in enumerate(marks):
            glue = skeleton[pos_skel:k]
            if not full.startswith(glue, pos_full):
                raise ItemError(
                    "template_mismatch", f"the template text before assistant message {i} depends on its content"
                )
            pos_full += len(glue)
            after = k + len(sentinels[i])
            next_glue = skeleton[after : marks[n + 1][1]] if n + 1 < len(marks) else skeleton[after:]
            is_last = n + 1 == len(marks)
            content = messages[i]["content"]
            for variant in dict.fromkeys((content, content.strip(), content.rstrip(), content.lstrip())):
                end = pos_full + len(variant)
                if not full.startswith(variant, pos_full):
                    continue
                if full.startswith(next_glue, end) and (not is_last or len(full) == end + len(next_glue)):
                    break
            else:
                raise ItemError(
                    "template_mismatch",
                    f"assistant message {i} does not appear verbatim (or stripped) in the rendered template",
                )
            spans.append((pos_full, end))
            pos_full = end
            pos_skel = after
        return spans

    def _mask(self, ids: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
        n = len(ids)
        mask = [0] * n
        t = 0
        for cs, ce in spans:
            while t < n and offsets[t][1] <= cs:
                t += 1
            # every token overlapping [cs, ce): a token straddling a boundary counts as content
            while t < n and offsets[t][0] < ce:
                if offsets[t][1] > cs:
                    mask[t] = 1
                t += 1
            # the end-of-turn token is the template's first token after the content. Added tokens
            # are split off before BPE, so a special end-of-turn token always starts exactly at ce.
            if t < n and offsets[t][0] == ce and offsets[t][1] > ce:
                mask[t] = 1
                self.end_of_turn_tokens[self.tok.convert_ids_to_tokens(ids[t])] += 1
                t += 1
        return mask

    def _check_reference(self, messages: list[dict[str, str]], ids: list[int]) -> None:
        ref: Any = self.tok.apply_chat_template(messages, tokenize=True)
        if isinstance(ref, Mapping) or hasattr(ref, "keys"):
            ref = ref["input_ids"]
        ref = list(ref)
        if ref and isinstance(ref[0], list):
            ref = ref[0]
        if ref != ids:
            raise EaglenestError(
                "tokenizing the rendered chat template text gives different ids than "
                "apply_chat_template(tokenize=True); refusing to build a loss mask on a different tokenization"
            )
        self._reference_checks += 1
