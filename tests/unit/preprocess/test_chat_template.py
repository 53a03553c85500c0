"""ChatTemplate renders exactly as transformers' apply_chat_template (real-world templates), and
maps template failures to InvalidArgument."""

# ruff: noqa: E501  (the real-world templates below are kept verbatim, long lines included)

from __future__ import annotations

import gc
import itertools
from typing import Any

import jinja2
import pytest
import tokenizers
from transformers import PreTrainedTokenizerFast

from dynamo.preprocess import ChatTemplate, ModelDir, Tokenizer, demo_model_path
from dynamo.runtime.errors import InvalidArgument

# --- Real-world templates, as published in the models' tokenizer_config.json -----------------

QWEN25_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | "
    "trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token + ' ' }}{% else %}{{ raise_exception('Only user and "
    "assistant roles are supported!') }}{% endif %}{% endfor %}"
)

GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role "
    "not supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == 'user') "
    "!= (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == 'assistant') %}"
    "{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)

# Exercises the rest of the environment: namespace, loop controls, dict(), tojson options,
# reasoning_content, content parts, extra kwargs, the {% generation %} tag.
FEATURES_TEMPLATE = """\
{%- set ns = namespace(turns=0, last_user=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'system' and not loop.first %}{% continue %}{% endif %}
    {%- set ns.turns = ns.turns + 1 %}
    {{- '<|' + message.role + '|>' }}
    {%- if message.reasoning_content is defined and loop.index0 > ns.last_user %}
        {{- '<think>' + message.reasoning_content + '</think>' }}
    {%- endif %}
    {%- if message.content is string %}
        {{- message.content }}
    {%- else %}
        {%- for part in message.content %}{{ part.text }}{% endfor %}
    {%- endif %}
    {%- if message.role == 'assistant' %}{% generation %}<|end|>{% endgeneration %}{% endif %}
    {{- '\\n' }}
{%- endfor %}
{%- if tools %}{{ tools | tojson(indent=2, sort_keys=True) }}{{ tools | tojson(ensure_ascii=True) }}{% endif %}
{{- dict(turns=ns.turns) | tojson(separators=(',', ':')) }}
{%- if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}
"""

TEMPLATES = {
    "qwen2.5": QWEN25_TEMPLATE,
    "llama3": LLAMA3_TEMPLATE,
    "mistral": MISTRAL_TEMPLATE,
    "gemma": GEMMA_TEMPLATE,
    "features": FEATURES_TEMPLATE,
    "demo-llama3.1": "",  # filled from the demo model's tokenizer_config.json
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Wetter für eine Stadt (z. B. Köln) — returns °C",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]

CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "single": [{"role": "user", "content": "Hello!"}],
    "system-multi-turn": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "  What is 2+2?  "},
        {"role": "assistant", "content": "4", "reasoning_content": "simple sum"},
        {"role": "user", "content": "And 3+3?"},
    ],
    "unicode": [{"role": "user", "content": "你好 🦄 café — naïve résumé?"}],
    "no-alternation": [
        {"role": "user", "content": "one"},
        {"role": "user", "content": "two"},
    ],
    "tool-flow": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ],
    "content-parts": [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Part one, "}, {"type": "text", "text": "two."}],
        }
    ],
    "assistant-last": [
        {"role": "user", "content": "Finish this: the quick"},
        {"role": "assistant", "content": "brown fox"},
    ],
}


@pytest.fixture(scope="module")
def templates(demo_model: ModelDir) -> dict[str, str]:
    assert demo_model.chat_template is not None
    return {**TEMPLATES, "demo-llama3.1": demo_model.chat_template.source()}


@pytest.fixture(scope="module")
def hf_tokenizer() -> PreTrainedTokenizerFast:
    raw = tokenizers.Tokenizer.from_file(str(demo_model_path() / "tokenizer.json"))
    return PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"
    )


def hf_render(hf: PreTrainedTokenizerFast, template: str, **kwargs: Any) -> str | Exception:
    try:
        out = hf.apply_chat_template(chat_template=template, tokenize=False, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the error itself is what we compare
        return exc
    assert isinstance(out, str)
    return out


CASES = list(
    itertools.product(TEMPLATES, CONVERSATIONS, [False, True], [False, True], [{}, {"x": 1}])
)


@pytest.mark.parametrize(
    ("template_name", "conversation", "gen_prompt", "with_tools", "extra"), CASES
)
def test_renders_exactly_like_transformers(
    templates: dict[str, str],
    hf_tokenizer: PreTrainedTokenizerFast,
    template_name: str,
    conversation: str,
    gen_prompt: bool,
    with_tools: bool,
    extra: dict[str, Any],
) -> None:
    source = templates[template_name]
    messages = CONVERSATIONS[conversation]
    tools = TOOLS if with_tools else None
    kwargs: dict[str, Any] = {"add_generation_prompt": gen_prompt, "tools": tools, **extra}
    if template_name == "features":
        kwargs["enable_thinking"] = False
    expected = hf_render(hf_tokenizer, source, conversation=messages, **kwargs)
    ours = ChatTemplate(source, hf_tokenizer.special_tokens_map)
    if isinstance(expected, Exception):
        with pytest.raises(InvalidArgument) as info:
            ours.render(messages, **kwargs)
        if isinstance(expected, jinja2.TemplateError):
            assert str(expected) in str(info.value)
    else:
        assert ours.render(messages, **kwargs) == expected


def test_every_template_renders_some_conversation_without_error(
    templates: dict[str, str], hf_tokenizer: PreTrainedTokenizerFast
) -> None:
    # Guards the parity test against comparing only errors.
    for source in templates.values():
        ok = [
            m
            for m in CONVERSATIONS.values()
            if isinstance(hf_render(hf_tokenizer, source, conversation=m), str)
        ]
        assert len(ok) >= 3


@pytest.mark.parametrize("template_name", ["qwen2.5", "demo-llama3.1", "features"])
def test_continue_final_message_like_transformers(
    templates: dict[str, str], hf_tokenizer: PreTrainedTokenizerFast, template_name: str
) -> None:
    source = templates[template_name]
    messages = CONVERSATIONS["assistant-last"]
    expected = hf_render(hf_tokenizer, source, conversation=messages, continue_final_message=True)
    assert isinstance(expected, str) and expected.endswith("brown fox")
    ours = ChatTemplate(source, hf_tokenizer.special_tokens_map)
    assert ours.render(messages, continue_final_message=True) == expected
    with pytest.raises(InvalidArgument):
        ours.render(messages, continue_final_message=True, add_generation_prompt=True)


def test_token_ids_match_apply_chat_template(
    demo_model: ModelDir, hf_tokenizer: PreTrainedTokenizerFast, templates: dict[str, str]
) -> None:
    tokenizer: Tokenizer = demo_model.tokenizer
    assert demo_model.chat_template is not None
    for messages in (CONVERSATIONS["system-multi-turn"], CONVERSATIONS["unicode"]):
        text = demo_model.chat_template.render(messages, add_generation_prompt=True)
        expected = hf_tokenizer.apply_chat_template(
            messages,
            chat_template=templates["demo-llama3.1"],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        assert tokenizer.encode(text, add_special_tokens=False) == list(expected)


def test_raise_exception_becomes_invalid_argument_with_its_message() -> None:
    template = ChatTemplate(MISTRAL_TEMPLATE, {"bos_token": "<s>", "eos_token": "</s>"})
    with pytest.raises(InvalidArgument, match="Conversation roles must alternate"):
        template.render(CONVERSATIONS["no-alternation"])


def test_demo_template_rejects_unknown_roles(demo_model: ModelDir) -> None:
    assert demo_model.chat_template is not None
    with pytest.raises(InvalidArgument, match="Unsupported role: wizard"):
        demo_model.chat_template.render([{"role": "wizard", "content": "hi"}])


def test_sandbox_blocks_unsafe_access() -> None:
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(InvalidArgument):
        ChatTemplate(escape).render([{"role": "user", "content": "x"}])
    mutate = "{% set _ = messages.append(1) %}{{ messages | length }}"
    with pytest.raises(InvalidArgument):
        ChatTemplate(mutate).render([{"role": "user", "content": "x"}])
    private = "{% set ns = namespace() %}{% set ns._secret = 1 %}"
    with pytest.raises(InvalidArgument):
        ChatTemplate(private).render([{"role": "user", "content": "x"}])


def test_input_errors_are_invalid_argument() -> None:
    template = ChatTemplate(QWEN25_TEMPLATE)
    with pytest.raises(InvalidArgument):
        template.render([])
    with pytest.raises(InvalidArgument, match="TypeError"):  # str + list in the template
        template.render([{"role": "user", "content": [{"type": "image"}]}])
    with pytest.raises(InvalidArgument):
        template.render(["not a message"])  # type: ignore[list-item]


def test_bad_template_fails_at_load() -> None:
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for x in %}")
    with pytest.raises(ValueError):
        ChatTemplate({})


def test_named_templates_select_tool_use_when_tools_given() -> None:
    template = ChatTemplate({"default": "plain", "tool_use": "tools:{{ tools | length }}"})
    user = [{"role": "user", "content": "x"}]
    assert template.render(user) == "plain"
    assert template.render(user, tools=TOOLS) == "tools:1"
    assert template.render(user, tools=TOOLS, template_name="default") == "plain"
    with pytest.raises(InvalidArgument):
        template.render(user, template_name="nope")
    assert ChatTemplate({"only": "x"}).render(user) == "x"
    with pytest.raises(InvalidArgument):
        ChatTemplate({"a": "1", "b": "2"}).render(user)


def test_strftime_now_and_special_token_override() -> None:
    template = ChatTemplate("{{ strftime_now('%Y') }}|{{ bos_token }}", {"bos_token": "<s>"})
    rendered = template.render([{"role": "user", "content": "x"}])
    year, bos = rendered.split("|")
    assert year.isdigit() and len(year) == 4 and bos == "<s>"
    assert template.render([{"role": "user", "content": "x"}], bos_token="B").endswith("|B")


def test_a_render_with_macros_leaves_no_cyclic_garbage(demo_model: ModelDir) -> None:
    # The demo template defines a macro, a closure over the render's context; a render must
    # leave nothing for the garbage collector (at c=64 that garbage ran the frontend's young
    # collections on its event loop). DEBUG_SAVEALL keeps what a collection finds unreachable.
    template = demo_model.chat_template
    assert template is not None
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    expected = template.render(messages, add_generation_prompt=True)
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(3):
            assert template.render(messages, add_generation_prompt=True) == expected
        gc.collect()
        left = [
            o for o in gc.garbage if isinstance(o, jinja2.runtime.Context | jinja2.runtime.Macro)
        ]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert left == []
