"""``check_supported``: every OpenAI / NvExt field an engine may lack is refused by name (400,
``param`` = the field) unless the engine's card advertises it; neutral values always pass; and
the request's guided-decoding constraint is read from every place a client may put it."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from dynamo.frontend.capabilities import check_supported, serving_capabilities
from dynamo.frontend.errors import to_http
from dynamo.frontend.request_params import guided_decoding, output_logprobs, wants_timing
from dynamo.protocol.model_card import EngineCapabilities, ModelCard
from dynamo.protocol.openai import ChatCompletionRequest, CompletionRequest
from dynamo.protocol.request import GuidedDecodingOptions
from dynamo.runtime.errors import InvalidArgument
from tests.fakes import make_card

NONE = EngineCapabilities()
ALL = EngineCapabilities(
    logprobs=True,
    max_top_logprobs=20,
    prompt_logprobs=True,
    min_p=True,
    repetition_penalty=True,
    presence_penalty=True,
    frequency_penalty=True,
    guided_decoding=True,
)
MSGS = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> ChatCompletionRequest:
    body = {"model": "m", "messages": MSGS, **fields}
    return msgspec.json.decode(msgspec.json.encode(body), type=ChatCompletionRequest)


def completion(**fields: Any) -> CompletionRequest:
    body = {"model": "m", "prompt": "hi", **fields}
    return msgspec.json.decode(msgspec.json.encode(body), type=CompletionRequest)


def refused(req: ChatCompletionRequest | CompletionRequest, caps: EngineCapabilities) -> str:
    with pytest.raises(InvalidArgument) as info:
        check_supported(req, caps)
    assert info.value.param is not None
    return info.value.param


# Each request asks for one engine capability: refused by an engine without it, accepted by one
# that has it.
NEEDS_ENGINE = [
    (chat(logprobs=True), "logprobs"),
    (chat(logprobs=True, top_logprobs=3), "logprobs"),
    (completion(logprobs=2), "logprobs"),
    (chat(presence_penalty=0.5), "presence_penalty"),
    (completion(frequency_penalty=-1.0), "frequency_penalty"),
    (chat(min_p=0.1), "min_p"),
    (chat(repetition_penalty=1.2), "repetition_penalty"),
    (chat(nvext={"repetition_penalty": 0.9}), "nvext.repetition_penalty"),
    (chat(response_format={"type": "json_object"}), "response_format"),
    (
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
        "response_format",
    ),
    (chat(guided_regex="a+"), "guided_regex"),
    (completion(guided_choice=["yes", "no"]), "guided_choice"),
    (chat(nvext={"guided_json": {"type": "object"}}), "nvext.guided_json"),
    (chat(nvext={"guided_regex": "[0-9]+"}), "nvext.guided_regex"),
    (chat(nvext={"guided_choice": ["a", "b"]}), "nvext.guided_choice"),
    (chat(nvext={"guided_grammar": 'root ::= "a"'}), "nvext.guided_grammar"),
]


@pytest.mark.parametrize(("req", "param"), NEEDS_ENGINE)
def test_engine_capability_refused_by_name_then_honoured(
    req: ChatCompletionRequest | CompletionRequest, param: str
) -> None:
    assert refused(req, NONE) == param
    check_supported(req, ALL)


def test_the_400_names_the_field() -> None:
    with pytest.raises(InvalidArgument) as info:
        check_supported(chat(min_p=0.2), NONE)
    reply = to_http(info.value)
    body = msgspec.json.decode(reply.body)
    assert reply.status == 400
    assert body["error"]["param"] == "min_p"
    assert "min_p" in body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error"


def test_echo_with_logprobs_needs_prompt_logprobs() -> None:
    caps = EngineCapabilities(logprobs=True, max_top_logprobs=5)
    check_supported(completion(echo=True), NONE)  # echo alone is the frontend's
    check_supported(completion(logprobs=1), caps)
    assert refused(completion(echo=True, logprobs=1), caps) == "echo"


def test_top_logprobs_beyond_the_engine_maximum() -> None:
    caps = EngineCapabilities(logprobs=True, max_top_logprobs=2)
    check_supported(chat(logprobs=True, top_logprobs=2), caps)
    assert refused(chat(logprobs=True, top_logprobs=3), caps) == "top_logprobs"
    assert refused(completion(logprobs=3), caps) == "logprobs"


@pytest.mark.parametrize(
    "req",
    [
        chat(presence_penalty=0.0, frequency_penalty=0.0, min_p=0.0, repetition_penalty=1.0),
        chat(response_format={"type": "text"}, tool_choice="auto", tools=[]),
        chat(tool_choice="none", parallel_tool_calls=True, logprobs=False),
        completion(best_of=1, echo=False),
        completion(n=3, best_of=3),
        chat(nvext={"annotations": ["timing", "request_id"], "extra_fields": ["worker_id"]}),
        chat(user="someone", stream_options={"include_usage": True}, modalities=["text"]),
    ],
)
def test_neutral_values_ask_for_nothing(req: ChatCompletionRequest | CompletionRequest) -> None:
    check_supported(req, NONE)


# Fields no engine here can honour: refused whatever the card says.
NEVER = [
    (completion(suffix="tail"), "suffix"),
    (completion(best_of=2), "best_of"),
    (completion(n=2, best_of=1), "best_of"),
    (chat(tool_choice="required"), "tool_choice"),
    (chat(tool_choice={"type": "function", "function": {"name": "f"}}), "tool_choice"),
    (chat(parallel_tool_calls=False), "parallel_tool_calls"),
    (chat(logit_bias={"42": 5.0}), "logit_bias"),
    (chat(functions=[{"name": "f"}]), "functions"),
    (completion(stream_options={"continuous_usage_stats": True}), "stream_options"),
    (chat(function_call="auto"), "function_call"),
    (chat(modalities=["text", "audio"]), "modalities"),
    (chat(audio={"voice": "x", "format": "wav"}), "audio"),
    (chat(top_logprobs=2), "top_logprobs"),
    (chat(response_format={"type": "json_schema"}), "response_format"),
    (chat(nvext={"annotations": ["bogus"]}), "nvext.annotations"),
    (chat(nvext={"extra_fields": ["routed_experts"]}), "nvext.extra_fields"),
    (chat(guided_decoding_backend="xgrammar"), "guided_decoding_backend"),
    (chat(nvext={"guided_whitespace_pattern": " "}), "nvext.guided_whitespace_pattern"),
    (chat(guided_regex="a", nvext={"guided_choice": ["a"]}), "nvext.guided_choice"),
    (chat(nvext={"guided_regex": ""}), "nvext.guided_regex"),
    (chat(guided_json="{not json"), "guided_json"),
]


@pytest.mark.parametrize(("req", "param"), NEVER)
def test_fields_nothing_here_honours(
    req: ChatCompletionRequest | CompletionRequest, param: str
) -> None:
    assert refused(req, ALL) == param


def test_unknown_response_format_type_is_a_validation_error() -> None:
    with pytest.raises(msgspec.ValidationError) as info:
        chat(response_format={"type": "yaml"})
    assert to_http(info.value).status == 400


def test_an_unknown_nvext_key_is_a_400_naming_it() -> None:
    with pytest.raises(msgspec.ValidationError) as info:
        chat(nvext={"session_control": {"action": "open"}})
    reply = to_http(info.value)
    assert reply.status == 400
    error = msgspec.json.decode(reply.body)["error"]
    assert error["param"] == "nvext" and "session_control" in error["message"]


def test_guided_decoding_from_every_place() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    cases = [
        (chat(response_format={"type": "json_object"}), GuidedDecodingOptions(json_object=True)),
        (
            chat(response_format={"type": "json_schema", "json_schema": {"schema": schema}}),
            GuidedDecodingOptions(json=schema),
        ),
        (chat(nvext={"guided_json": schema}), GuidedDecodingOptions(json=schema)),
        (
            chat(guided_json=msgspec.json.encode(schema).decode()),
            GuidedDecodingOptions(json=schema),
        ),
        (completion(guided_regex="a|b"), GuidedDecodingOptions(regex="a|b")),
        (chat(nvext={"guided_choice": ["x", "y"]}), GuidedDecodingOptions(choice=["x", "y"])),
        (completion(nvext={"guided_grammar": "g"}), GuidedDecodingOptions(grammar="g")),
    ]
    for req, expected in cases:
        found = guided_decoding(req)
        assert found is not None and found[1] == expected
    assert guided_decoding(chat(response_format={"type": "text"})) is None


def test_output_logprobs_mapping() -> None:
    assert output_logprobs(chat()) == (None, None)
    assert output_logprobs(chat(logprobs=True)) == (0, None)
    assert output_logprobs(chat(logprobs=True, top_logprobs=4)) == (4, None)
    assert output_logprobs(completion(logprobs=0)) == (0, None)
    assert output_logprobs(completion(logprobs=3, echo=True)) == (3, 3)
    assert output_logprobs(completion(echo=True)) == (None, None)


def test_timing_asked_either_way() -> None:
    assert wants_timing(chat(nvext={"annotations": ["timing"]}))
    assert wants_timing(chat(nvext={"extra_fields": ["timing"]}))
    assert not wants_timing(chat(nvext={"extra_fields": ["worker_id"]}))
    assert not wants_timing(chat())


def _card(instance_id: int, caps: EngineCapabilities) -> ModelCard:
    return make_card(
        instance_id,
        served_model_name="m",
        model_path="p",
        namespace="ns",
        component="c",
        endpoint="e",
        context_length=64,
        capabilities=caps,
    )


def test_serving_capabilities_is_what_every_worker_honours() -> None:
    assert serving_capabilities([]) is None
    assert serving_capabilities([_card(1, ALL), _card(2, ALL)]) == ALL
    some = EngineCapabilities(logprobs=True, max_top_logprobs=5, min_p=True)
    common = serving_capabilities([_card(1, ALL), _card(2, some)])
    assert common == EngineCapabilities(logprobs=True, max_top_logprobs=5, min_p=True)
    assert common is not None
    check_supported(chat(min_p=0.5), common)
    assert refused(chat(presence_penalty=1.0), common) == "presence_penalty"
