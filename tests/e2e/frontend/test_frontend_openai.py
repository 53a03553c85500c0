"""The official openai client against `dynamo serve` (frontend + 2 mockers in subprocesses):
chat and completions, streaming and unary, n=2, stop strings, include_usage, annotations."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.e2e.frontend.frontend_stack import Stack, request

pytestmark = pytest.mark.e2e

MODEL = "demo"
MESSAGES: list[Any] = [{"role": "user", "content": "Tell me a story about a dragon."}]


@pytest.fixture(scope="module")
def client(serve_stack: Stack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"http://127.0.0.1:{serve_stack.port}/v1", api_key="none", max_retries=0
    ) as c:
        yield c


def _nvext(obj: Any) -> dict[str, Any] | None:
    extra = obj.model_extra or {}
    value = extra.get("nvext")
    return value if isinstance(value, dict) else None


# -- chat ------------------------------------------------------------------------------------


def test_chat_unary(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, seed=1)
    assert r.object == "chat.completion"
    assert r.id.startswith("chatcmpl-") and r.model == MODEL
    assert len(r.choices) == 1
    choice = r.choices[0]
    assert choice.index == 0 and choice.finish_reason == "length"
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert r.usage is not None
    assert r.usage.completion_tokens == 8
    assert r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_chat_stream_matches_unary_and_include_usage(client: openai.OpenAI) -> None:
    unary = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, seed=7)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=12,
        seed=7,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert {c.id for c in chunks} == {chunks[0].id}
    assert {c.model for c in chunks} == {MODEL}
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0].choices[0].delta.role == "assistant"
    # the usage chunk is last, with empty choices; before it, the finish_reason chunk
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12
    assert unary.usage is not None
    assert chunks[-1].usage.prompt_tokens == unary.usage.prompt_tokens
    body = [c for c in chunks[:-1]]
    assert all(c.usage is None for c in body)
    assert body[-1].choices[0].finish_reason == "length"
    assert all(ch.finish_reason is None for c in body[:-1] for ch in c.choices)
    text = "".join(ch.delta.content or "" for c in body for ch in c.choices)
    assert text == unary.choices[0].message.content


def test_chat_stream_without_include_usage_has_no_usage(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, stream=True)
    )
    assert all(c.usage is None for c in chunks)
    assert all(c.choices for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_n2_unary_and_stream(client: openai.OpenAI) -> None:
    one = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, seed=3)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, n=2, seed=3)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.finish_reason == "length" and c.message.content for c in r.choices)
    assert r.usage is not None and one.usage is not None
    assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == one.usage.prompt_tokens  # a prompt is counted once

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=6,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts: dict[int, str] = {0: "", 1: ""}
    roles: set[int] = set()
    finished: dict[int, str] = {}
    for c in chunks:
        for ch in c.choices:
            if ch.delta.role == "assistant":
                roles.add(ch.index)
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason is not None:
                assert ch.index not in finished
                finished[ch.index] = ch.finish_reason
    assert roles == {0, 1}
    assert finished == {0: "length", 1: "length"}
    assert all(texts.values())
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


# -- completions -------------------------------------------------------------------------------


def test_completions_unary_stream_and_batch(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, seed=2)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert len(r.choices) == 1 and r.choices[0].finish_reason == "length" and r.choices[0].text
    assert r.usage is not None and r.usage.completion_tokens == 5

    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="Once upon a time",
            max_tokens=5,
            seed=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert {c.id for c in chunks} == {chunks[0].id}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    text = "".join(ch.text for c in chunks[:-1] for ch in c.choices)
    assert text == r.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length"

    # token ids as the prompt, and a batch of two prompts (OpenAI order: prompt-major)
    ids = client.completions.create(model=MODEL, prompt=[100, 200, 300, 400], max_tokens=3)
    assert ids.usage is not None and ids.usage.prompt_tokens == 4
    batch = client.completions.create(model=MODEL, prompt=["a b c", "d e f g h"], max_tokens=4)
    assert sorted(c.index for c in batch.choices) == [0, 1]
    assert batch.usage is not None and batch.usage.completion_tokens == 8


def test_completions_n2_stream(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, n=2, stream=True)
    )
    reasons = {ch.index: ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason}
    assert reasons == {0: "length", 1: "length"}


# -- annotations ---------------------------------------------------------------------------------


def test_annotations_streaming(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=6,
        stream=True,
        extra_headers={"x-request-id": "annot-req-1"},
        extra_body={"nvext": {"annotations": ["request_id", "formatted_prompt", "token_ids"]}},
    )
    chunks = list(stream)
    nvexts = [n for n in (_nvext(c) for c in chunks) if n]
    request_ids = [n["request_id"] for n in nvexts if "request_id" in n]
    prompts = [n["formatted_prompt"] for n in nvexts if "formatted_prompt" in n]
    token_ids = [t for n in nvexts if "token_ids" in n for t in n["token_ids"]]
    assert request_ids == ["annot-req-1"]
    assert len(prompts) == 1 and "Tell me a story about a dragon." in prompts[0]
    assert len(token_ids) == 6 and all(isinstance(t, int) for t in token_ids)
    assert all(c.id == "chatcmpl-annot-req-1" for c in chunks)
    text = "".join(ch.delta.content or "" for c in chunks for ch in c.choices)
    assert text


def test_annotations_unary(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL,
        prompt="Hello there",
        max_tokens=4,
        extra_body={"nvext": {"annotations": ["request_id", "formatted_prompt", "token_ids"]}},
    )
    nv = _nvext(r)
    assert nv is not None
    assert nv["formatted_prompt"].endswith("Hello there")
    assert len(nv["token_ids"]) == 4
    assert r.id == f"cmpl-{nv['request_id']}"


def test_sampling_fields_in_nvext_and_top_level(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=4,
        extra_body={
            "top_k": 5,
            "repetition_penalty": 1.0,  # neutral: the mocker honours no penalty (else a 400)
            "min_tokens": 2,
            "nvext": {"top_k": 40, "greedy_sampling": True, "ignore_eos": True},
        },
    )
    assert r.usage is not None and r.usage.completion_tokens == 4


# -- stop strings through the HTTP API -------------------------------------------------------------


def _full_text(client: openai.OpenAI, seed: int, max_tokens: int = 40) -> str:
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=max_tokens, seed=seed)
    return r.choices[0].text


def _expect(text: str, stops: list[str]) -> str:
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    return text[:cut]


def _run_stop(client: openai.OpenAI, seed: int, stops: list[str]) -> tuple[str, str, str]:
    """(unary text, streamed text, finish_reason) of the same seeded request with ``stops``."""
    unary = client.completions.create(
        model=MODEL, prompt="abc", max_tokens=40, seed=seed, stop=stops
    )
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="abc", max_tokens=40, seed=seed, stop=stops, stream=True
        )
    )
    streamed = "".join(ch.text for c in chunks for ch in c.choices)
    reason = next(ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason)
    assert unary.choices[0].finish_reason == reason
    return unary.choices[0].text, streamed, reason


def test_stop_strings_never_leak(client: openai.OpenAI) -> None:
    full = _full_text(client, seed=11)
    assert len(full) > 30, full
    first = full[10:14]
    second = full[20:23]
    for stops in ([first], [second, first], ["\u2603never-there", second]):
        unary, streamed, reason = _run_stop(client, 11, stops)
        want = _expect(full, stops)
        assert unary == want and streamed == want, (stops, full)
        assert reason == "stop"
        assert not any(s in unary for s in stops)
    # no stop string occurs: the whole text, finish_reason length
    unary, streamed, reason = _run_stop(client, 11, ["\u2603never-there"])
    assert unary == streamed == full and reason == "length"


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
    derandomize=True,
)
@given(
    seed=st.integers(0, 10_000),
    spans=st.lists(st.tuples(st.integers(0, 60), st.integers(1, 6)), min_size=1, max_size=3),
)
def test_stop_strings_property(client: openai.OpenAI, seed: int, spans: list[Any]) -> None:
    """Stop strings taken from the seeded output itself (so they occur): the output is the
    reference truncation of the full text, unary and streamed alike, and never contains one."""
    full = _full_text(client, seed)
    stops = [full[a : a + n] for a, n in spans]
    stops = [s for s in stops if s.strip() and "\ufffd" not in s]
    if not stops:
        return
    unary, streamed, reason = _run_stop(client, seed, stops)
    want = _expect(full, stops)
    assert unary == want and streamed == want, (stops, full)
    assert not any(s in streamed for s in stops)
    assert reason == "stop"


# -- request ids, listings, health --------------------------------------------------------------


def test_request_id_headers_echoed(serve_stack: Stack) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
    for header in ("x-request-id", "x-dynamo-request-id"):
        status, headers, raw = request(
            serve_stack.port,
            "POST",
            "/v1/chat/completions",
            body,
            headers={header: f"my-id-{header}"},
        )
        assert status == 200, raw
        assert headers["x-request-id"] == f"my-id-{header}"
        assert headers["x-dynamo-request-id"] == f"my-id-{header}"
        assert b'"id":"chatcmpl-my-id-' in raw
    status, headers, raw = request(
        serve_stack.port,
        "POST",
        "/v1/chat/completions",
        {**body, "stream": True},
        headers={"x-request-id": "stream-id"},
    )
    assert status == 200 and headers["x-request-id"] == "stream-id"
    assert headers["content-type"].startswith("text/event-stream")
    assert raw.endswith(b"data: [DONE]\n\n")
    # without a header the frontend makes one up, and still echoes it
    status, headers, _ = request(serve_stack.port, "POST", "/v1/chat/completions", body)
    assert status == 200 and len(headers["x-request-id"]) >= 16


def test_models_listings(client: openai.OpenAI, serve_stack: Stack) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].object == "model" and models.data[0].owned_by == "nvidia"
    one = client.models.retrieve(MODEL)
    assert one.id == MODEL and one.created > 0
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")

    import json

    status, _, raw = request(serve_stack.port, "GET", "/dynamo/alpha/list-models")
    assert status == 200
    listing = json.loads(raw)
    assert listing["chat_completion_models"] == [MODEL]
    assert listing["completion_models"] == [MODEL]
    (m,) = listing["models"]
    assert m["name"] == MODEL and m["context_length"] == 8192
    assert len(m["live_instances"]) == 2


def test_health_and_live(serve_stack: Stack) -> None:
    import json

    status, _, raw = request(serve_stack.port, "GET", "/health")
    assert status == 200
    health = json.loads(raw)
    assert health["status"] == "healthy"
    assert len(health["instances"]) == 2
    assert {i["model"] for i in health["instances"]} == {MODEL}
    status, _, raw = request(serve_stack.port, "GET", "/live")
    assert status == 200 and json.loads(raw)["status"] == "live"


# -- logprobs and echo across processes (the TCP request plane carries them) ----------------------


def test_logprobs_and_echo_across_processes(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, logprobs=True, top_logprobs=2, seed=4
    )
    lp = r.choices[0].logprobs
    assert lp is not None and lp.content is not None and len(lp.content) == 5
    assert all(len(e.top_logprobs) == 2 and e.logprob < 0 for e in lp.content)
    c = client.completions.create(model=MODEL, prompt="abc", max_tokens=3, logprobs=1, echo=True)
    choice = c.choices[0]
    assert choice.text.startswith("abc") and choice.logprobs is not None
    assert c.usage is not None and choice.logprobs.tokens is not None
    assert len(choice.logprobs.tokens) == c.usage.prompt_tokens + 3
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"min_p": 0.1})
    assert info.value.param == "min_p"
