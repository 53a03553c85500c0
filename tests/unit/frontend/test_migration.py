"""Request migration and instant failover through the generate handler's fake Exchange: a
migrated stream reads as one stream (no duplicated or missing token, one terminal), and
cancellations, invalid input, engine errors and guided decoding are never migrated."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from dynamo.frontend.migration import MigrationPolicy
from dynamo.protocol.model_card import EngineCapabilities
from dynamo.runtime.errors import (
    CannotConnect,
    DynamoError,
    EngineShutdown,
    InvalidArgument,
    Overloaded,
    ResponseTimeout,
    StreamIncomplete,
)
from tests.unit.frontend.handler_kit import (
    TEXT6,
    WORDS,
    Kit,
    Script,
    card,
    make_kit,
    sse_events,
)
from tests.unit.frontend.test_generate_handler import _exchange_of

pytestmark = pytest.mark.unit

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}
STREAM = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}


def kit_with(script: Script, limit: int | None = 3, **policy: int) -> Kit:
    kit = make_kit(script)
    kit.handler._migration = MigrationPolicy(limit, metrics=kit.metrics, **policy)
    return kit


def migrations(kit: Kit, kind: str) -> float:
    value = kit.metrics.registry.get_sample_value(
        "dynamo_frontend_model_migration_total", {"model": "demo", "migration_type": kind}
    )
    return value or 0.0


def streamed_text(body: str) -> tuple[str, list[dict[str, object]]]:
    events = sse_events(body)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(
        c["choices"][0]["delta"].get("content", "")  # type: ignore[index]
        for c in chunks
        if c.get("choices")
    )
    return text, chunks


@pytest.mark.parametrize(
    "error", [StreamIncomplete("cut"), EngineShutdown("bye"), ResponseTimeout("silent")]
)
async def test_a_stream_broken_mid_way_continues_on_another_instance(error: DynamoError) -> None:
    kit = kit_with(Script(fail=error, fail_after=3, failing_streams=1))
    kit.router.workers = {1, 2}
    http = await kit.call(STREAM)
    assert http.status == 200, http.text
    text, chunks = streamed_text(http.text)
    assert text == TEXT6, "no token lost or repeated"
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]  # type: ignore[index]
    assert [f for f in finishes if f] == ["length"]
    assert chunks[-1]["usage"]["completion_tokens"] == 6  # type: ignore[index]
    assert kit.requests_total() == {("success", ""): 1}
    first, second = kit.worker.sent
    assert second.request_id == first.request_id
    assert second.token_ids == first.token_ids + WORDS[:3]
    assert second.stop.max_tokens == 3
    assert kit.worker.targets[0] != kit.worker.targets[1]
    assert kit.worker.down == [kit.worker.targets[0]], "the failed instance left routing"
    assert kit.router.workers == {kit.worker.targets[1]}, "and its router forgot its load"
    assert migrations(kit, "ongoing_request") == 1
    duration = kit.metrics.registry.get_sample_value(
        "dynamo_frontend_model_migration_duration_seconds_count", {"outcome": "success"}
    )
    assert duration == 1
    assert kit.router.outstanding == 0 and kit.gauge("active_requests") == 0


async def test_unary_and_new_request_migration() -> None:
    kit = kit_with(Script(fail=CannotConnect("refused"), fail_after=0, failing_streams=1))
    http = await kit.call(CHAT)
    assert http.status == 200, http.text
    assert http.json()["choices"][0]["message"]["content"] == TEXT6
    assert http.json()["usage"]["completion_tokens"] == 6
    assert migrations(kit, "new_request") == 1 and migrations(kit, "ongoing_request") == 0


async def test_worker_overload_migrates_without_taking_the_instance_down() -> None:
    kit = kit_with(Script(fail=Overloaded("busy"), fail_after=0, failing_streams=1))
    http = await kit.call(CHAT)
    assert http.status == 200, http.text
    assert kit.worker.down == []
    assert kit.worker.targets[0] != kit.worker.targets[1]


async def test_limit_zero_fails_with_an_error_event_but_still_fails_over() -> None:
    kit = kit_with(Script(fail=StreamIncomplete("cut"), fail_after=3), limit=0)
    http = await kit.call(STREAM)
    assert http.status == 200
    assert "event: error" in http.text and sse_events(http.text)[-1] == "[DONE]"
    assert len(kit.worker.sent) == 1
    assert kit.worker.down == [kit.worker.targets[0]]
    assert kit.requests_total() == {("error", "internal"): 1}
    kit.assert_routed_and_freed_once()


async def test_the_limit_bounds_the_attempts() -> None:
    kit = kit_with(Script(fail=StreamIncomplete("cut"), fail_after=1), limit=2)
    kit.worker.ids = [1, 2, 3, 4]
    entry = kit.handler._registry.get("demo")  # type: ignore[attr-defined]
    entry.put_card(card(3))
    entry.put_card(card(4))
    http = await kit.call(STREAM)
    assert "event: error" in http.text
    assert len(kit.worker.sent) == 3, "the first attempt and two migrations"
    assert migrations(kit, "ongoing_request") == 1  # the second failed before a token
    assert migrations(kit, "new_request") == 1
    failed = kit.metrics.registry.get_sample_value(
        "dynamo_frontend_model_migration_duration_seconds_count", {"outcome": "failure"}
    )
    assert failed == 1


async def test_the_model_cards_limit_applies_when_the_frontend_sets_none() -> None:
    kit = kit_with(Script(fail=StreamIncomplete("cut"), fail_after=2, failing_streams=1), None)
    for c in kit.handler._registry.get("demo").cards.values():  # type: ignore[attr-defined]
        c.migration_limit = 1
    http = await kit.call(STREAM)
    assert streamed_text(http.text)[0] == TEXT6


async def test_no_instance_left_surfaces_the_original_failure() -> None:
    kit = kit_with(Script(fail=StreamIncomplete("cut short"), fail_after=2))
    kit.worker.ids = [1]
    http = await kit.call(STREAM)
    assert "cut short" in http.text and "event: error" in http.text
    assert len(kit.worker.sent) == 1


@pytest.mark.parametrize("error", [InvalidArgument("bad input"), DynamoError("engine bug")])
async def test_invalid_input_and_engine_errors_are_not_migrated(error: DynamoError) -> None:
    kit = kit_with(Script(fail=error, fail_after=0))
    http = await kit.call(CHAT)
    assert http.status in (400, 500), http.text
    assert len(kit.worker.sent) == 1 and kit.worker.down == []
    assert migrations(kit, "new_request") == 0


async def test_a_cancelled_request_is_not_migrated() -> None:
    kit = kit_with(Script(hang_after=2))
    task = asyncio.create_task(kit.call(STREAM))
    async with asyncio.timeout(5):
        while kit.router.first_tokens.total() == 0:
            await asyncio.sleep(0.001)
    _exchange_of(task).disconnect()
    await asyncio.wait_for(task, 5)
    assert len(kit.worker.sent) == 1
    assert kit.requests_total() == {("error", "cancelled"): 1}
    assert migrations(kit, "ongoing_request") == 0


async def test_guided_decoding_is_not_migrated() -> None:
    kit = kit_with(Script(fail=StreamIncomplete("cut"), fail_after=2))
    entry = kit.handler._registry.get("demo")  # type: ignore[attr-defined]
    for c in list(entry.cards.values()):
        entry.put_card(
            msgspec.structs.replace(c, capabilities=EngineCapabilities(guided_decoding=True))
        )
    http = await kit.call({**STREAM, "nvext": {"guided_regex": "[a-z]+"}})
    assert http.status == 200, http.text
    assert "event: error" in http.text
    assert len(kit.worker.sent) == 1
    assert kit.worker.sent[0].sampling.guided_decoding is not None


async def test_max_seq_len_exceeded_stops_migration() -> None:
    kit = kit_with(Script(fail=StreamIncomplete("cut"), fail_after=3, failing_streams=1))
    kit.handler._migration = MigrationPolicy(3, max_seq_len=1, metrics=kit.metrics)
    http = await kit.call(STREAM)
    assert "event: error" in http.text
    assert len(kit.worker.sent) == 1
    prompt_len = len(kit.worker.sent[0].token_ids)
    exceeded = kit.metrics.registry.get_sample_value(
        "dynamo_frontend_model_migration_max_seq_len_exceeded_total", {"model": "demo"}
    )
    assert exceeded == 1
    # Equal to the limit is still migratable.
    kit2 = kit_with(Script(fail=StreamIncomplete("cut"), fail_after=3, failing_streams=1))
    kit2.handler._migration = MigrationPolicy(3, max_seq_len=prompt_len + 3, metrics=kit2.metrics)
    http2 = await kit2.call(STREAM)
    assert streamed_text(http2.text)[0] == TEXT6


async def test_all_tokens_received_but_the_terminal_lost_finishes_with_length() -> None:
    kit = kit_with(Script(fail=StreamIncomplete("cut"), fail_after=6, failing_streams=1))
    http = await kit.call(STREAM)
    text, chunks = streamed_text(http.text)
    assert text == TEXT6
    assert len(kit.worker.sent) == 1, "nothing left to generate: no second attempt"
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]  # type: ignore[index]
    assert finishes[-1] == "length"
