"""The loss mask on real chat templates: exactly each assistant content + its end-of-turn token.

SmolLM2's own ChatML template, plus the published Llama-3.1-Instruct and Qwen2.5-Instruct templates
attached to SmolLM2's tokenizer (with their special tokens added), so nothing is downloaded.
"""

from __future__ import annotations

import pytest

from eaglenest.data.chat import ChatEncoder
from eaglenest.data.rows import ItemError

# meta-llama/Llama-3.1-8B-Instruct tokenizer_config.json chat_template
LLAMA31_TEMPLATE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# Qwen/Qwen2.5-7B-Instruct tokenizer_config.json chat_template
QWEN25_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Qwen3-style: the template rewrites assistant content (drops the <think> block)
THINK_STRIPPING_TEMPLATE = (
    "{%- for m in messages %}{%- set c = m.content %}"
    "{%- if m.role == 'assistant' and '</think>' in c %}{%- set c = c.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>' + m.role + '\\n' + c + '<|im_end|>\\n' }}{%- endfor %}"
)

# Gemma-style role-alternation check
ALTERNATING_TEMPLATE = (
    "{%- for m in messages %}{%- if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
)


def _tokenizer(path, template: str | None = None, special: list[str] | None = None, bos: str | None = None):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if special:
        tok.add_special_tokens({"additional_special_tokens": special})
    if bos:
        tok.bos_token = bos
    if template:
        tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def smol_tok(smollm2):
    return _tokenizer(smollm2)


@pytest.fixture(scope="module")
def llama_tok(smollm2):
    special = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]
    return _tokenizer(smollm2, LLAMA31_TEMPLATE, special, bos="<|begin_of_text|>")


@pytest.fixture(scope="module")
def qwen_tok(smollm2):
    # <|im_start|>/<|im_end|> are already special tokens of SmolLM2's tokenizer
    return _tokenizer(smollm2, QWEN25_TEMPLATE)


# template fixture, its end-of-turn token, a default system text it injects when there is none
TEMPLATES = {
    "chatml_smollm2": ("smol_tok", "<|im_end|>", "You are a helpful AI assistant named SmolLM"),
    "llama31": ("llama_tok", "<|eot_id|>", "Cutting Knowledge Date: December 2023"),
    "qwen25": ("qwen_tok", "<|im_end|>", "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."),
}

SYSTEM = {"role": "system", "content": "You are terse. Answer in one line."}
SINGLE = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
]
MULTI = [
    {"role": "user", "content": "Write a Python function that adds two numbers."},
    {"role": "assistant", "content": "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\nCall add(1, 2) to get 3."},
    {"role": "user", "content": "Repeat after me: ok"},
    {"role": "assistant", "content": "Repeat after me: ok"},  # same text as the user turn: no naive search
    {"role": "user", "content": "Une phrase en français, s'il te plaît ☕"},
    {"role": "assistant", "content": "Voilà : « Le café est prêt. » ☕ 日本語も"},
]
CONVERSATIONS = {
    "single": SINGLE,
    "multi": MULTI,
    "single_system": [SYSTEM, *SINGLE],
    "multi_system": [SYSTEM, *MULTI],
}


def masked_spans(mask: list[int]) -> list[tuple[int, int]]:
    spans, i = [], 0
    while i < len(mask):
        if mask[i]:
            j = i
            while j < len(mask) and mask[j]:
                j += 1
            spans.append((i, j))
            i = j
        else:
            i += 1
    return spans


def decode(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def assert_mask(tok, messages, eot: str, expected_contents: list[str]) -> tuple[list[int], list[int]]:
    ids, mask = ChatEncoder(tok).encode(messages)
    ref = tok.apply_chat_template(messages, tokenize=True)
    ref = ref["input_ids"] if hasattr(ref, "keys") else ref
    assert ids == list(ref), "ids must be exactly what apply_chat_template(tokenize=True) gives"
    assert len(mask) == len(ids) and set(mask) <= {0, 1}
    spans = masked_spans(mask)
    assert len(spans) == len(expected_contents), "one masked span per assistant turn"
    for (a, b), content in zip(spans, expected_contents):
        assert decode(tok, ids[a:b]) == content + eot
        assert ids[b - 1] == tok.convert_tokens_to_ids(eot)
    # nothing else: the masked tokens are exactly those spans
    assert sum(mask) == sum(b - a for a, b in spans)
    return ids, mask


@pytest.mark.parametrize("conv", list(CONVERSATIONS))
@pytest.mark.parametrize("template", list(TEMPLATES))
def test_mask_is_exactly_assistant_content_plus_end_of_turn(request, template, conv):
    fixture, eot, default_system = TEMPLATES[template]
    tok = request.getfixturevalue(fixture)
    messages = CONVERSATIONS[conv]
    expected = [m["content"] for m in messages if m["role"] == "assistant"]
    ids, mask = assert_mask(tok, messages, eot, expected)
    text = decode(tok, ids)
    masked_text = "".join(decode(tok, ids[a:b]) for a, b in masked_spans(mask))
    # the template's own system text (default or given) is in the sequence but never masked
    system_text = SYSTEM["content"] if conv.endswith("_system") else default_system
    assert system_text in text and system_text not in masked_text
    for m in messages:
        if m["role"] == "user" and m["content"] not in expected:
            assert m["content"] not in masked_text
    # the token right after each end-of-turn (ChatML's newline, the next header) is not masked
    for _, b in masked_spans(mask):
        assert b == len(mask) or mask[b] == 0


def test_llama_trims_content_and_mask_follows_the_render(llama_tok):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "  Hello there!\n\n"}]
    assert_mask(llama_tok, messages, "<|eot_id|>", ["Hello there!"])


def test_chatml_keeps_surrounding_whitespace_of_content(smol_tok):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there!\n\n"}]
    assert_mask(smol_tok, messages, "<|im_end|>", ["Hello there!\n\n"])


def test_leading_assistant_turn_is_kept_and_masked(smol_tok):
    messages = [
        {"role": "assistant", "content": "Welcome! How can I help?"},
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did the chicken cross the road?"},
    ]
    assert_mask(smol_tok, messages, "<|im_end|>", [messages[0]["content"], messages[2]["content"]])


def test_empty_assistant_turn_stays_in_text_but_is_not_masked(qwen_tok):
    messages = [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "two"},
        {"role": "assistant", "content": "Second answer."},
    ]
    assert_mask(qwen_tok, messages, "<|im_end|>", ["Second answer."])


def test_no_assistant_content_is_an_item_error(smol_tok):
    with pytest.raises(ItemError) as e:
        ChatEncoder(smol_tok).encode([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}])
    assert e.value.reason == "no_assistant"


def test_template_that_rewrites_content_is_template_mismatch(smollm2):
    tok = _tokenizer(smollm2, THINK_STRIPPING_TEMPLATE)
    enc = ChatEncoder(tok)
    ok = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    assert_mask(tok, ok, "<|im_end|>", ["4"])
    with pytest.raises(ItemError) as e:
        enc.encode([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>easy</think>\n4"}])
    assert e.value.reason == "template_mismatch"


def test_template_exception_is_template_error(smollm2):
    tok = _tokenizer(smollm2, ALTERNATING_TEMPLATE)
    with pytest.raises(ItemError) as e:
        ChatEncoder(tok).encode([{"role": "assistant", "content": "first"}, {"role": "user", "content": "hi"}])
    assert e.value.reason == "template_error"
    assert "must alternate" in e.value.message
