"""The generate handlers through the fake Exchange (no sockets): every outcome counts
requests_total exactly once and moves the router's load exactly once (routed, then freed)."""

from __future__ import annotations

import asyncio
import json

import pytest

from dynamo.frontend.attempt import Timeouts
from dynamo.frontend.keepalive import KEEP_ALIVE
from dynamo.runtime.errors import StreamIncomplete, WorkerShutdown
from tests.fakes import FakeExchange
from tests.unit.frontend.handler_kit import TEXT6, Script, make_kit, sse_events

pytestmark = pytest.mark.unit

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}


def stream(**extra: object) -> dict[str, object]:
    return {**CHAT, "stream": True, **extra}


async def test_unary_success() -> None:
    kit = make_kit()
    http = await kit.call(CHAT)
    assert http.status == 200, http.text
    body = http.json()
    assert body["choices"][0]["message"]["content"] == TEXT6
    assert body["choices"][0]["finish_reason"] == "length"
    assert kit.requests_total() == {("success", ""): 1}
    kit.assert_routed_and_freed_once()
    assert kit.router.first_tokens == kit.router.selected
    assert kit.gauge("active_requests") == 0
    assert kit.handler.inflight == 0


async def test_streaming_success() -> None:
    kit = make_kit()
    http = await kit.call(stream(stream_options={"include_usage": True}))
    assert http.status == 200 and http.streaming
    events = sse_events(http.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == TEXT6
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    assert kit.requests_total() == {("success", ""): 1}
    kit.assert_routed_and_freed_once()


@pytest.mark.parametrize("streaming", [False, True])
async def test_engine_error_before_the_first_token_is_an_http_error(streaming: bool) -> None:
    kit = make_kit(Script(fail=WorkerShutdown("the worker is shutting down"), fail_after=0))
    http = await kit.call(stream() if streaming else CHAT)
    assert http.status == 502 and not http.streaming, http.text
    assert "shutting down" in http.json()["error"]["message"]
    assert kit.requests_total() == {("error", "unavailable"): 1}
    kit.assert_routed_and_freed_once()
    assert kit.gauge("active_requests") == 0


async def test_engine_error_after_the_first_token_is_an_sse_error_event() -> None:
    kit = make_kit(Script(fail=StreamIncomplete("stream ended early"), fail_after=2))
    http = await kit.call(stream())
    assert http.status == 200 and http.streaming
    assert "event: error" in http.text and "stream ended early" in http.text
    assert sse_events(http.text)[-1] == "[DONE]"
    assert kit.requests_total() == {("error", "internal"): 1}
    kit.assert_routed_and_freed_once()
    assert kit.gauge("active_requests") == 0


async def test_unary_engine_error_after_the_first_token() -> None:
    kit = make_kit(Script(fail=StreamIncomplete("stream ended early"), fail_after=3))
    http = await kit.call(CHAT)
    assert http.status == 502
    assert kit.requests_total() == {("error", "internal"): 1}
    kit.assert_routed_and_freed_once()


@pytest.mark.parametrize("streaming", [False, True])
async def test_client_disconnect_stops_the_engine_and_counts_once(streaming: bool) -> None:
    kit = make_kit(Script(hang_after=2))
    task = asyncio.create_task(kit.call(stream() if streaming else CHAT))
    async with asyncio.timeout(5):  # until the handler waits on the engine after a token
        while kit.router.first_tokens.total() == 0:
            await asyncio.sleep(0.001)
    assert kit.handler.inflight == 1
    _exchange_of(task).disconnect()  # the client goes away
    http = await asyncio.wait_for(task, 5)
    assert kit.worker.contexts[0].is_stopped(), "the engine was told to stop"
    assert kit.requests_total() == {("error", "cancelled"): 1}
    kit.assert_routed_and_freed_once()
    assert kit.worker.open_streams == 0
    cancellations = kit.metrics.registry.get_sample_value(
        "dynamo_frontend_model_cancellation_total",
        {
            "model": "demo",
            "endpoint": "chat_completions",
            "request_type": "stream" if streaming else "unary",
        },
    )
    assert cancellations == 1
    if not streaming:
        assert http.status is None, "nobody to answer"


def _exchange_of(task: asyncio.Task[FakeExchange]) -> FakeExchange:
    """The FakeExchange a pending kit.call() task holds (its coroutine's local)."""
    frame = task.get_coro().cr_frame  # type: ignore[union-attr]
    assert frame is not None
    http: FakeExchange = frame.f_locals["http"]
    return http


async def test_n_choices_route_and_free_each_choice_once() -> None:
    kit = make_kit()
    http = await kit.call({**CHAT, "n": 3, "nvext": {"dp_rank": None}})
    assert http.status == 200, http.text
    body = http.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert kit.requests_total() == {("success", ""): 1}
    kit.assert_routed_and_freed_once(n=3)
    # every choice went out with its own placement: no shared, mutated routing hints
    ranks = sorted(r.routing.dp_rank for r in kit.worker.sent if r.routing is not None)
    assert ranks == [0, 1, 2]
    assert len({id(r.routing) for r in kit.worker.sent}) == 3


async def test_n_choices_streaming_with_one_failing() -> None:
    kit = make_kit(Script(fail=StreamIncomplete("gone"), fail_after=4))
    http = await kit.call(stream(n=2))
    assert http.status == 200
    assert "event: error" in http.text
    assert kit.requests_total() == {("error", "internal"): 1}
    kit.assert_routed_and_freed_once(n=2)
    assert kit.worker.open_streams == 0


async def test_rejections_and_validation_errors_count_once() -> None:
    kit = make_kit()
    bad = await kit.call({"model": "demo"})
    assert bad.status == 400
    unknown = await kit.call({**CHAT, "model": "nope"})
    assert unknown.status == 404
    kit.handler.draining = True
    drained = await kit.call(CHAT)
    assert drained.status == 503
    assert kit.requests_total() == {
        ("error", "validation"): 1,
        ("error", "not_found"): 1,
        ("error", "unavailable"): 1,
    }
    assert not kit.router.selected


async def test_first_response_timeout_is_504() -> None:
    kit = make_kit(Script(hang_after=0, silent=True), timeouts=Timeouts(0.05, 5.0))
    http = await asyncio.wait_for(kit.call(stream()), 5)
    assert http.status == 504, http.text
    assert "first response" in http.json()["error"]["message"]
    assert kit.requests_total() == {("error", "response_timeout"): 1}
    kit.assert_routed_and_freed_once()
    assert kit.worker.open_streams == 0


async def test_inter_chunk_timeout_ends_the_stream_with_an_error_event() -> None:
    kit = make_kit(Script(hang_after=2, silent=True), timeouts=Timeouts(5.0, 0.05))
    http = await asyncio.wait_for(kit.call(stream()), 5)
    assert http.status == 200
    assert "event: error" in http.text and "next response" in http.text
    assert kit.requests_total() == {("error", "response_timeout"): 1}
    kit.assert_routed_and_freed_once()


async def test_idle_stream_gets_keep_alive_comments() -> None:
    release = asyncio.Event()
    kit = make_kit(Script(hang_after=2, release=release), keep_alive_s=0.01)
    task = asyncio.create_task(kit.call(stream()))
    async with asyncio.timeout(5):
        while True:
            await asyncio.sleep(0.005)
            if task.done():
                break
            if KEEP_ALIVE in _exchange_of(task).chunks:
                break
    release.set()
    http = await asyncio.wait_for(task, 5)
    assert KEEP_ALIVE in http.chunks
    events = sse_events(http.text)
    assert events[-1] == "[DONE]"
    text = "".join(
        json.loads(e)["choices"][0]["delta"].get("content", "")
        for e in events[:-1]
        if json.loads(e)["choices"]
    )
    assert text == TEXT6
    assert kit.requests_total() == {("success", ""): 1}


async def test_concurrent_requests_tokenize_on_the_thread_with_the_same_result() -> None:
    kit = make_kit()
    alone = await kit.call(CHAT)  # nothing else in flight: tokenized inline
    assert kit.handler.offload.encoder.jobs == 0
    calls = [kit.call(stream() if i % 2 else CHAT) for i in range(4)]
    https = await asyncio.gather(*calls)
    # the first of the four ran alone; the others found it in flight
    assert kit.handler.offload.encoder.jobs >= 1
    prompts = {len(r.token_ids) for r in kit.worker.sent}
    assert prompts == {alone.json()["usage"]["prompt_tokens"]}
    for i, http in enumerate(https):
        assert http.status == 200, http.text
        if not i % 2:
            assert http.json()["choices"][0]["message"]["content"] == TEXT6
    assert kit.requests_total() == {("success", ""): 5}
    kit.assert_routed_and_freed_once(n=5)
    kit.handler.offload.close()
