"""No OpenAI or NvExt field silently ignored, end to end over real HTTP (issue 11).

Every field is either honoured by an engine whose card advertises it (the mocker for logprobs,
echo and timing; a recording engine advertising everything for guided decoding, penalties and
min_p, which checks that they reach it intact) or answered 400 naming the field by one that
does not. The official ``openai`` client parses the logprobs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import openai
import pytest

from dynamo.backend.engine import EngineConfig, LLMEngine
from dynamo.backend.worker import Worker, WorkerConfig
from dynamo.preprocess import demo_model_path
from dynamo.protocol.model_card import EngineCapabilities
from dynamo.protocol.output import FinishReason, LLMEngineOutput, TopLogprob, Usage
from dynamo.protocol.request import GuidedDecodingOptions, PreprocessedRequest
from dynamo.runtime.context import Context
from dynamo.runtime.runtime import DistributedRuntime
from tests.integration.conftest import RUNTIME, Stack

pytestmark = pytest.mark.integration

CHAT, COMPLETIONS = "chat/completions", "completions"
MSGS = [{"role": "user", "content": "Tell me about dragons."}]
EVERYTHING = EngineCapabilities(
    logprobs=True,
    max_top_logprobs=5,
    prompt_logprobs=True,
    min_p=True,
    repetition_penalty=True,
    presence_penalty=True,
    frequency_penalty=True,
    guided_decoding=True,
)


class RecordingEngine(LLMEngine):
    """Advertises every capability, records each request it gets, answers with tokens 300,
    301, ... (with log-probabilities when asked)."""

    def __init__(self) -> None:
        self.requests: list[PreprocessedRequest] = []

    async def start(self, worker_id: int) -> EngineConfig:
        return EngineConfig(
            model=str(demo_model_path()),
            served_model_name="rec",
            context_length=4096,
            capabilities=EVERYTHING,
        )

    async def generate(
        self, request: PreprocessedRequest, ctx: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        self.requests.append(request)
        n = request.stop.max_tokens or 4
        top = request.output.logprobs
        for i in range(n):
            out = LLMEngineOutput(token_ids=[300 + i])
            if top is not None:
                out.log_probs = [-0.5]
                out.top_logprobs = [[TopLogprob(300 + i + k, -0.5 - k) for k in range(top)]]
            if i == 0 and request.output.prompt_logprobs is not None:
                out.prompt_logprobs = [None] + [-1.0] * (len(request.token_ids) - 1)
            if i == n - 1:
                out.finish_reason = FinishReason.LENGTH
                out.usage = Usage(prompt_tokens=len(request.token_ids), completion_tokens=n)
            yield out

    async def cleanup(self) -> None:
        pass


async def add_recording_worker(stack: Stack) -> RecordingEngine:
    engine = RecordingEngine()
    config = WorkerConfig(
        runtime=RUNTIME,
        model_path=str(demo_model_path()),
        served_model_name="rec",
        component="rec",
        install_signal_handlers=False,
    )
    worker = Worker([engine], config, runtime=DistributedRuntime(RUNTIME, stack.hub))
    stack.workers.append(worker)
    stack.tasks.append(asyncio.create_task(worker.run(), name="recording-worker"))
    await asyncio.wait_for(worker.ready.wait(), 10)
    return engine


@pytest.fixture
async def mocker(stack: Stack) -> AsyncIterator[openai.AsyncOpenAI]:
    await stack.add_worker("--speedup-ratio", "0")
    await stack.start_frontend()
    await stack.wait_for_model()
    assert stack.frontend is not None
    async with openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{stack.frontend.port}/v1", api_key="none", max_retries=0
    ) as client:
        yield client


# -- honoured by the mocker --------------------------------------------------------------------


async def test_chat_logprobs_unary_and_streamed(mocker: openai.AsyncOpenAI) -> None:
    kw: dict[str, Any] = dict(
        model="demo", messages=MSGS, max_tokens=10, seed=3, logprobs=True, top_logprobs=3
    )
    r = await mocker.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert r.usage is not None and len(content) == r.usage.completion_tokens == 10
    for entry in content:
        assert entry.logprob < 0 and len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
    # the tokens' bytes are the answer's text
    data = b"".join(bytes(e.bytes or []) for e in content)
    assert data.decode("utf-8", "replace") == choice.message.content

    streamed = []
    stream = await mocker.chat.completions.create(**kw, stream=True)
    async for chunk in stream:
        for c in chunk.choices:
            if c.logprobs is not None and c.logprobs.content:
                streamed += c.logprobs.content
    assert streamed == content  # seeded: the same tokens and numbers


async def test_chat_without_logprobs_has_none(mocker: openai.AsyncOpenAI) -> None:
    r = await mocker.chat.completions.create(model="demo", messages=MSGS, max_tokens=4)
    assert r.choices[0].logprobs is None


async def test_completion_logprobs_and_echo(mocker: openai.AsyncOpenAI) -> None:
    prompt = "Once upon a time"
    r = await mocker.completions.create(
        model="demo", prompt=prompt, max_tokens=6, logprobs=2, echo=True, seed=9
    )
    choice = r.choices[0]
    assert r.usage is not None
    assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert len(lp.tokens) == r.usage.prompt_tokens + 6
    assert lp.token_logprobs[0] is None  # the first prompt token has no log-probability
    assert lp.top_logprobs is not None and all(len(t) <= 2 for t in lp.top_logprobs[-6:])
    assert lp.text_offset is not None and lp.text_offset == sorted(lp.text_offset)

    text, tokens = "", []
    stream = await mocker.completions.create(
        model="demo", prompt=prompt, max_tokens=6, logprobs=2, echo=True, seed=9, stream=True
    )
    async for chunk in stream:
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens or []
    assert text == choice.text and tokens == lp.tokens


async def test_echo_alone_and_with_n(mocker: openai.AsyncOpenAI) -> None:
    r = await mocker.completions.create(
        model="demo", prompt=["abc", "xyz"], max_tokens=3, echo=True, n=2, best_of=2
    )
    assert [c.text[:3] for c in sorted(r.choices, key=lambda c: c.index)] == [
        "abc",
        "abc",
        "xyz",
        "xyz",
    ]
    assert all(c.logprobs is None for c in r.choices)


async def test_timing_annotation(stack: Stack, mocker: openai.AsyncOpenAI) -> None:
    assert stack.client is not None
    before = time.time() * 1000
    body = {"model": "demo", "prompt": "hi", "max_tokens": 4, "nvext": {"annotations": ["timing"]}}
    r = await stack.client.post("/v1/completions", json=body)
    assert r.status_code == 200
    timing = r.json()["nvext"]["timing"]
    assert before - 1000 <= timing["request_received_ms"] <= time.time() * 1000 + 1000
    assert 0 <= timing["ttft_ms"] <= timing["total_time_ms"]
    assert 0 <= timing["prefill_wait_time_ms"] <= timing["ttft_ms"]
    parts = timing["prefill_wait_time_ms"] + timing["prefill_time_ms"]
    assert abs(parts - timing["ttft_ms"]) < 0.01

    body = {**body, "stream": True, "nvext": {"extra_fields": ["timing"]}}
    async with stack.client.stream("POST", "/v1/completions", json=body) as s:
        events = [
            msgspec.json.decode(line[6:])
            async for line in s.aiter_lines()
            if line.startswith("data: {")
        ]
    assert "timing" in events[-1]["nvext"] and events[-1]["choices"] == []
    assert all("nvext" not in e for e in events[:-1])


# -- refused by the mocker, by name ----------------------------------------------------------

REFUSED: list[tuple[str, dict[str, Any], str]] = [
    (CHAT, {"presence_penalty": 0.5}, "presence_penalty"),
    (CHAT, {"frequency_penalty": 0.5}, "frequency_penalty"),
    (COMPLETIONS, {"min_p": 0.05}, "min_p"),
    (CHAT, {"repetition_penalty": 1.1}, "repetition_penalty"),
    (CHAT, {"nvext": {"repetition_penalty": 1.1}}, "nvext.repetition_penalty"),
    (CHAT, {"response_format": {"type": "json_object"}}, "response_format"),
    (
        CHAT,
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
        "response_format",
    ),
    (CHAT, {"nvext": {"guided_json": {"type": "object"}}}, "nvext.guided_json"),
    (CHAT, {"nvext": {"guided_regex": "a+"}}, "nvext.guided_regex"),
    (COMPLETIONS, {"nvext": {"guided_choice": ["a"]}}, "nvext.guided_choice"),
    (COMPLETIONS, {"nvext": {"guided_grammar": "root ::= 'a'"}}, "nvext.guided_grammar"),
    (CHAT, {"guided_regex": "a+"}, "guided_regex"),
    (CHAT, {"tools": [], "tool_choice": "required"}, "tool_choice"),
    (COMPLETIONS, {"suffix": "end"}, "suffix"),
    (COMPLETIONS, {"best_of": 3}, "best_of"),
    (CHAT, {"logit_bias": {"5": 1.0}}, "logit_bias"),
    (CHAT, {"logprobs": True, "top_logprobs": 25}, "top_logprobs"),
    (COMPLETIONS, {"logprobs": 21}, "logprobs"),
    (CHAT, {"nvext": {"annotations": ["nope"]}}, "nvext.annotations"),
]


async def test_the_mocker_refuses_the_rest_by_name(
    stack: Stack, mocker: openai.AsyncOpenAI
) -> None:
    assert stack.client is not None
    for endpoint, fields, param in REFUSED:
        for stream in (False, True):
            body: dict[str, Any] = {"model": "demo", "max_tokens": 2, "stream": stream, **fields}
            if endpoint == CHAT:
                body["messages"] = MSGS
            else:
                body["prompt"] = "hi"
            r = await stack.client.post(f"/v1/{endpoint}", json=body)
            assert r.status_code == 400, (fields, r.text)
            error = r.json()["error"]
            assert error["param"] == param, (fields, error)
            assert param.rsplit(".", 1)[-1] in error["message"]
    # the official client sees a BadRequestError naming the field
    with pytest.raises(openai.BadRequestError) as info:
        await mocker.chat.completions.create(
            model="demo", messages=MSGS, max_tokens=2, presence_penalty=1.0
        )
    assert info.value.param == "presence_penalty"


# -- honoured by an engine that advertises them --------------------------------------------------


async def test_fields_reach_an_engine_that_advertises_them(stack: Stack) -> None:
    engine = await add_recording_worker(stack)
    client = await stack.start_frontend()
    await stack.wait_for_model("rec")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    cases: list[tuple[str, dict[str, Any], Any]] = [
        (
            CHAT,
            {
                "presence_penalty": 0.5,
                "frequency_penalty": -0.25,
                "min_p": 0.05,
                "repetition_penalty": 1.2,
            },
            None,
        ),
        (
            CHAT,
            {"response_format": {"type": "json_object"}},
            GuidedDecodingOptions(json_object=True),
        ),
        (
            CHAT,
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": schema},
                }
            },
            GuidedDecodingOptions(json=schema),
        ),
        (
            CHAT,
            {"nvext": {"guided_json": schema}},
            GuidedDecodingOptions(json=schema),
        ),
        (
            COMPLETIONS,
            {"nvext": {"guided_regex": "[a-z]+"}},
            GuidedDecodingOptions(regex="[a-z]+"),
        ),
        (
            CHAT,
            {"nvext": {"guided_choice": ["yes", "no"]}},
            GuidedDecodingOptions(choice=["yes", "no"]),
        ),
        (
            COMPLETIONS,
            {"guided_grammar": 'root ::= "a"'},
            GuidedDecodingOptions(grammar='root ::= "a"'),
        ),
    ]
    for endpoint, fields, guided in cases:
        body: dict[str, Any] = {"model": "rec", "max_tokens": 3, **fields}
        if endpoint == CHAT:
            body["messages"] = MSGS
        else:
            body["prompt"] = "hi"
        r = await client.post(f"/v1/{endpoint}", json=body)
        assert r.status_code == 200, r.text
        got = engine.requests[-1].sampling
        assert got.guided_decoding == guided
    penalties = engine.requests[0].sampling
    assert (penalties.presence_penalty, penalties.frequency_penalty) == (0.5, -0.25)
    assert (penalties.min_p, penalties.repetition_penalty) == (0.05, 1.2)

    # logprobs and prompt logprobs are asked of the engine, and its numbers come back
    body = {"model": "rec", "prompt": "hi", "max_tokens": 3, "logprobs": 4, "echo": True}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    output = engine.requests[-1].output
    assert (output.logprobs, output.prompt_logprobs) == (4, 4)
    lp = r.json()["choices"][0]["logprobs"]
    n_prompt = len(engine.requests[-1].token_ids)
    assert lp["token_logprobs"] == [None] + [-1.0] * (n_prompt - 1) + [-0.5] * 3
    assert [len(t) for t in lp["top_logprobs"][n_prompt:]] == [4, 4, 4]
    # beyond the engine's advertised maximum: refused by name
    r = await client.post("/v1/completions", json={**body, "logprobs": 6})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


async def test_logprobs_end_where_a_stop_string_ends_the_text(mocker: openai.AsyncOpenAI) -> None:
    full = await mocker.completions.create(model="demo", prompt="abc", max_tokens=30, seed=11)
    text = full.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop and stop in text
    for stream in (False, True):
        kw: dict[str, Any] = dict(
            model="demo", prompt="abc", max_tokens=30, seed=11, stop=[stop], logprobs=1
        )
        tokens: list[str] = []
        got, usage_tokens = "", 0
        if stream:
            chunks = await mocker.completions.create(
                **kw, stream=True, stream_options={"include_usage": True}
            )
            async for chunk in chunks:
                for c in chunk.choices:
                    got += c.text
                    if c.logprobs is not None:
                        tokens += c.logprobs.tokens or []
                if chunk.usage is not None:
                    usage_tokens = chunk.usage.completion_tokens
        else:
            r = await mocker.completions.create(**kw)
            got = r.choices[0].text
            assert r.choices[0].logprobs is not None and r.usage is not None
            tokens, usage_tokens = r.choices[0].logprobs.tokens or [], r.usage.completion_tokens
        assert got == text[: text.find(stop)]
        # one entry per token the answer consumed: up to the one that completed the stop string
        assert len(tokens) == usage_tokens < 30
