"""Token ids and the loss mask of a conversation, derived from the target's own chat template.

The mask covers what the model generates in each assistant turn, as the template renders it:
from the end of the template's generation prompt (`add_generation_prompt=True` on the turns
before) to the end of the message's content, plus the one token the template puts right after
it (its end-of-turn token: `<|im_end|>`, `<|eot_id|>`, ...).  For most templates that is exactly
the content; for a reasoning template it also covers the thinking the template renders for that
turn (Qwen3: `<think>\n...\n</think>\n\n` on the turns after the last user message, nothing on
earlier ones; a template that drops reasoning drops it from the mask too).  `loss_on="last"`
masks only the final assistant turn (the Kimi-K2.5 draft recipes' choice for thinking data).

How the pieces are located without any per-model strings:
  1. render the conversation as is (`full`), and once more with every assistant content (and
     reasoning, `reasoning_content` / `thinking`) replaced by a unique alphanumeric sentinel
     (`skeleton`);
  2. walk the skeleton: the text between sentinels is the template's own glue (headers, system
     prompt, user turns). `full` must be exactly glue + piece + glue + piece + ... + glue,
     where each piece is the text verbatim or, for templates that trim it, stripped.
     Anything else (a template that drops or rewrites content, e.g. removes <think> blocks it was
     given inline) is a `template_mismatch`: we never guess;
  3. a turn's span starts where the generation prompt ends when the rendered prefix agrees with
     it, else at its first rendered piece; tokenize `full` with offsets and mask every token that
     overlaps a span, plus the token that starts exactly where the span ends (the end-of-turn token).
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


LOSS_ON = ("all", "last")
_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"


class ChatEncoder:
    def __init__(self, tokenizer: Any, loss_on: str = "all") -> None:
        if loss_on not in LOSS_ON:
            raise EaglenestError(f"loss_on must be one of {', '.join(LOSS_ON)} (got {loss_on!r})")
        self.loss_on = loss_on
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
        # a template that knows reasoning_content splits an inline <think> block off itself; so do we, first
        self._split_inline_think = "reasoning_content" in tokenizer.chat_template
        self.reasoning_turns = 0  # assistant turns whose rendered reasoning is under the mask
        # a template without a generation prompt renders the same text with and without one
        probe = [{"role": "user", "content": "hi"}]
        try:
            self._has_generation_prompt = self.render(probe, generation_prompt=True) != self.render(probe)
        except ItemError:  # a template that refuses a lone user turn: turns start at their first piece
            self._has_generation_prompt = False

    def render(self, messages: list[dict[str, str]], generation_prompt: bool = False) -> str:
        try:
            text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as e:  # jinja raise_exception(), role-alternation checks, ...
            raise ItemError("template_error", f"chat template failed: {type(e).__name__}: {e}") from None
        if not isinstance(text, str):
            raise ItemError("template_error", f"chat template returned {type(text).__name__}, not text")
        return text

    def encode(self, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
        """Token ids of the rendered conversation and its 0/1 loss mask."""
        if not messages:
            raise ItemError("empty_conversation", "conversation has no messages")
        messages = [self._with_reasoning(m) for m in messages]
        # whitespace-only assistant turns stay in the text but teach nothing: not masked
        targets = [i for i, m in enumerate(messages) if m["role"] == "assistant" and m["content"].strip()]
        if not targets:
            raise ItemError("no_assistant", "conversation has no assistant turn with content")
        if self.loss_on == "last":
            targets = targets[-1:]

        full = self.render(messages)
        spans = self._turn_spans(messages, targets, full)

        enc = self.tok(full, add_special_tokens=False, return_offsets_mapping=True)
        ids: list[int] = list(enc["input_ids"])
        offsets: list[tuple[int, int]] = [tuple(o) for o in enc["offset_mapping"]]
        if self._bos_id is not None and len(ids) >= 2 and ids[0] == ids[1] == self._bos_id:
            raise ItemError("template_mismatch", "rendered conversation starts with two BOS tokens")
        if self._reference_checks < _N_REFERENCE_CHECKS:
            self._check_reference(messages, ids)
        return ids, self._mask(ids, offsets, spans)

    def _with_reasoning(self, m: dict) -> dict:
        """Reasoning under the key the template reads (`reasoning_content`, or `thinking`:
        GPT-OSS's); an inline leading <think>...</think> is split off when the template knows
        reasoning_content (it would split it itself)."""
        if m["role"] != "assistant":
            return m
        r = m.get("reasoning_content")
        c = m["content"]
        if r is None and self._split_inline_think and c.lstrip().startswith(_THINK_OPEN) and _THINK_CLOSE in c:
            head, _, c = c.partition(_THINK_CLOSE)
            r, c = head.split(_THINK_OPEN, 1)[1].strip("\n"), c.lstrip("\n")
        if r is None:
            return m
        return {**m, "content": c, "reasoning_content": r, "thinking": r}

    def _sentinel(self, i: int, kind: str = "C") -> str:
        return f"EAGLENEST{self._nonce}{kind}SENTINEL{i}END"

    def _turn_spans(self, messages: list[dict], targets: list[int], full: str) -> list[tuple[int, int]]:
        """Character span of each target assistant turn inside `full` (see module docstring)."""
        pieces = self._piece_spans(messages, targets, full)  # (message index, start, end), in order
        spans: list[tuple[int, int]] = []
        prev_end = 0
        for i in targets:
            mine = [(a, b) for j, a, b in pieces if j == i]
            start, end = mine[0][0], mine[-1][1]
            gen_start = self._generation_start(messages[:i], full, prev_end, start)
            if len(mine) > 1:
                self.reasoning_turns += 1
            spans.append((start if gen_start is None else gen_start, end))
            prev_end = end
        return spans

    def _generation_start(self, before: list[dict], full: str, lo: int, hi: int) -> int | None:
        """Where the model starts generating this turn: the end of the generation prompt rendered
        on the turns before, if `full` starts with it and it ends between the previous span and
        this turn's first piece; else None."""
        if not before or not self._has_generation_prompt:
            return None
        try:
            prompt = self.render(before, generation_prompt=True)
        except ItemError:  # e.g. a template that refuses a conversation ending on an assistant turn
            return None
        if not full.startswith(prompt) or not lo <= len(prompt) <= hi:
            return None
        return len(prompt)

    def _piece_spans(self, messages: list[dict], targets: list[int], full: str) -> list[tuple[int, int, int]]:
        """(message index, start, end) in `full` of each target's rendered reasoning and content."""
        sentinels: dict[tuple[int, str], str] = {}
        skel_msgs = []
        for i, m in enumerate(messages):
            if i in targets:
                m = {**m, "content": self._sentinel(i)}
                sentinels[(i, "content")] = m["content"]
                if "reasoning_content" in m:
                    r = self._sentinel(i, "R")
                    m.update(reasoning_content=r, thinking=r)
                    sentinels[(i, "reasoning_content")] = r
            skel_msgs.append(m)
        if any(self._nonce in str(v) for m in messages for v in m.values()):  # astronomically unlikely
            raise ItemError("template_mismatch", "message content contains the sentinel marker")
        skeleton = self.render(skel_msgs)
        # the sentinels the template rendered (a template may drop reasoning), each once, in order
        marks: list[tuple[int, int, str]] = []  # (start in skeleton, message index, key)
        for (i, key), s in sentinels.items():
            k = skeleton.find(s)
            if k < 0 and key != "content":
                continue
            if k < 0 or skeleton.count(s) != 1:
                raise ItemError("template_mismatch", f"the template does not render assistant message {i} exactly once")
            marks.append((k, i, key))
        marks.sort()
        if [i for _, i, key in marks if key == "content"] != list(targets):
            raise ItemError("template_mismatch", "the template does not render the assistant messages in order")

        pieces: list[tuple[int, int, int]] = []
        pos_full = 0
        pos_skel = 0
        for n, (k, i, key) in enumerate(marks):
            glue = skeleton[pos_skel:k]
            if not full.startswith(glue, pos_full):
                raise ItemError(
                    "template_mismatch", f"the template text before assistant message {i} depends on its content"
                )
            pos_full += len(glue)
            after = k + len(sentinels[(i, key)])
            next_glue = skeleton[after : marks[n + 1][0]] if n + 1 < len(marks) else skeleton[after:]
            is_last = n + 1 == len(marks)
            text = messages[i][key]
            for variant in dict.fromkeys((text, text.strip(), text.rstrip(), text.lstrip(), text.strip("\n"))):
                end = pos_full + len(variant)
                if not full.startswith(variant, pos_full):
                    continue
                if full.startswith(next_glue, end) and (not is_last or len(full) == end + len(next_glue)):
                    break
            else:
                raise ItemError(
                    "template_mismatch",
                    f"assistant message {i}'s {key} does not appear verbatim (or stripped) in the rendered template",
                )
            pieces.append((i, pos_full, end))
            pos_full = end
            pos_skel = after
        return pieces

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
