"""Chat data for reasoning models: the thinking the template renders is kept and trained, as the
template renders it; `loss_on="last"` trains only the final assistant turn.

Templates written here and applied through SmolLM2's real tokenizer: Qwen3's published chat
template (tool branches left out), which renders `reasoning_content` as `<think>..</think>` only on
the turns after the last user message, and a DeepSeek-R1-style template, which drops reasoning from
the history and opens `<think>` in its generation prompt.
"""

from __future__ import annotations

import json

import pytest

from eaglenest.data.chat import ChatEncoder
from test_prepare_mask import _tokenizer, decode, masked_spans

# Qwen/Qwen3-8B tokenizer_config.json chat_template, without the tools / tool_call branches
QWEN3_TEMPLATE = r"""{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "system" %}
        {{- '<|im_start|>system\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

# DeepSeek-R1-style: reasoning never rendered in the history, `<think>` opened by the generation prompt
R1_TEMPLATE = (
    "{{ bos_token }}{%- for m in messages %}"
    "{%- if m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
    "{%- elif m['role'] == 'assistant' %}{%- set c = m['content'] %}"
    "{%- if '</think>' in c %}{%- set c = c.split('</think>')[-1] %}{%- endif %}"
    "{{ '<｜Assistant｜>' + c + '<｜end▁of▁sentence｜>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{%- endif %}"
)

CONV = [
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": "5.", "reasoning_content": "Two plus three.\nThat is five."},
    {"role": "user", "content": "And times 4?"},
    {"role": "assistant", "content": "20.", "reasoning_content": "5 * 4 = 20."},
]


@pytest.fixture(scope="module")
def qwen3_tok(smollm2):
    return _tokenizer(smollm2, QWEN3_TEMPLATE)


@pytest.fixture(scope="module")
def r1_tok(smollm2):
    return _tokenizer(smollm2, R1_TEMPLATE, ["<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"], bos="<｜begin▁of▁sentence｜>")


def _masked_texts(tok, messages, **kw) -> tuple[list[str], str]:
    ids, mask = ChatEncoder(tok, **kw).encode(messages)
    ref = tok.apply_chat_template(messages, tokenize=True)
    assert ids == list(ref["input_ids"] if hasattr(ref, "keys") else ref)
    return [decode(tok, ids[a:b]) for a, b in masked_spans(mask)], decode(tok, ids)


def test_qwen3_reasoning_is_trained_where_the_template_renders_it(qwen3_tok):
    spans, text = _masked_texts(qwen3_tok, CONV)
    # turn 1 comes before the last user message: Qwen3 renders it without its reasoning
    assert "Two plus three" not in text
    assert spans == ["5.<|im_end|>", "<think>\n5 * 4 = 20.\n</think>\n\n20.<|im_end|>"]


def test_qwen3_loss_on_last_turn_only(qwen3_tok):
    spans, text = _masked_texts(qwen3_tok, CONV, loss_on="last")
    assert spans == ["<think>\n5 * 4 = 20.\n</think>\n\n20.<|im_end|>"]
    assert "5.<|im_end|>" in text  # the earlier turn stays in the sequence, unmasked


def test_qwen3_inline_think_block_is_the_same_as_reasoning_content(qwen3_tok):
    inline = [{**m, "content": f"<think>\n{m['reasoning_content']}\n</think>\n\n{m['content']}"} if "reasoning_content" in m else m for m in CONV]
    inline = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in inline]
    assert _masked_texts(qwen3_tok, inline) == _masked_texts(qwen3_tok, CONV)


def test_qwen3_last_turn_without_reasoning_trains_the_empty_think_block(qwen3_tok):
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    spans, _ = _masked_texts(qwen3_tok, conv)
    assert spans == ["<think>\n\n</think>\n\nHello!<|im_end|>"]  # what the model generates in thinking mode


def test_r1_template_drops_reasoning_so_the_mask_does_too(r1_tok):
    spans, text = _masked_texts(r1_tok, CONV)
    assert "Two plus three" not in text and "5 * 4" not in text
    assert spans == ["5.<｜end▁of▁sentence｜>", "20.<｜end▁of▁sentence｜>"]


def test_prepare_reads_reasoning_fields_and_reports_them(tmp_path, smollm2, qwen3_tok):
    from eaglenest.data import PreparedData, prepare

    rows = [
        {"id": "a", "messages": CONV},
        {"id": "b", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo.", "reasoning": "greet back"}]},
        {"id": "c", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo.", "reasoning_content": 7}]},
    ]
    src = tmp_path / "chat.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    meta = prepare(model=str(smollm2), data=[src], out=tmp_path / "data", tokenizer=qwen3_tok, loss_on="last", verbose=False)
    assert meta["loss_on"] == "last"
    assert meta["failures"]["by_reason"] == {"wrong_type": 1}  # row c: reasoning must be text
    assert meta["notes"]["turns_with_reasoning_masked"] == 2
    data = PreparedData(tmp_path / "data")
    texts = {}
    for i in range(len(data)):
        s = data[i]
        texts[s.id] = "".join(decode(qwen3_tok, s.input_ids[a:b]) for a, b in masked_spans(list(s.loss_mask)))
    assert texts == {"a": "<think>\n5 * 4 = 20.\n</think>\n\n20.<|im_end|>", "b": "<think>\ngreet back\n</think>\n\nYo.<|im_end|>"}
