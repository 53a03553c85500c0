"""The router queue through the whole stack (FACTS §4.5): requests held while the worker's
prefill capacity is taken, served in policy order when it frees; the queue gauge on /metrics;
the queue limit's 529; the reference's dynamo_component_router_* families."""

from __future__ import annotations

import asyncio
import re
import time

import pytest

from dynamo.router.kv_router import KVRouter
from tests.integration.conftest import Stack, kv_settings

pytestmark = pytest.mark.integration

# One worker whose prefill is slow (a 1000-token prompt takes ~0.5 s) and whose decode is fast;
# with threshold 0, any prefill in flight saturates it: one request is admitted at a time.
MOCKER = (
    "--speedup-ratio",
    "0.05",
    "--decode-speedup-ratio",
    "1000",
    "--block-size",
    "16",
    "--max-num-batched-tokens",
    "2048",
)
PENDING = re.compile(
    r'^dynamo_frontend_router_queue_pending_requests\{policy_class="default",'
    r'worker_type="(\w+)"\} ([0-9.]+)$',
    re.M,
)


def _prompt(tag: str, words: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(words))


async def _first_chunk_at(stack: Stack, tag: str, words: int, **extra: object) -> float:
    """Stream a completion; the time its first token arrives."""
    assert stack.client is not None
    headers = extra.pop("headers", {})
    body = {"model": "demo", "prompt": _prompt(tag, words), "max_tokens": 2, "stream": True}
    body.update(extra)
    async with stack.client.stream(
        "POST",
        "/v1/completions",
        json=body,
        headers=headers,  # type: ignore[arg-type]
    ) as r:
        assert r.status_code == 200, await r.aread()
        first: float | None = None
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.monotonic()
        assert first is not None
        return first


def _pending(text: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in PENDING.finditer(text)}


def _router(stack: Stack) -> KVRouter:
    assert stack.frontend is not None
    entry = next(m for m in stack.frontend.registry.models() if m.name == "demo")
    router = entry.router
    assert isinstance(router, KVRouter) and router.queue is not None
    return router


async def test_held_requests_are_served_in_policy_order_and_the_gauge_follows(
    stack: Stack,
) -> None:
    await stack.add_worker(*MOCKER)
    client = await stack.start_frontend(
        router_mode="kv", kv=kv_settings(queue_threshold=0.0, queue_max_requests=3)
    )
    await stack.wait_for_model()
    queue = _router(stack).queue
    assert queue is not None
    metrics = (await client.get("/metrics")).text
    assert _pending(metrics) == {"agg": 0.0}
    assert "dynamo_component_router_requests_started_total{" in metrics  # there from the start

    blocker = asyncio.ensure_future(_first_chunk_at(stack, "blocker", 1000))
    async with asyncio.timeout(10):  # the blocker is routed: its prefill saturates the worker
        while not _router(stack).sequences.active_prefill_tokens(
            next(iter(_router(stack).core.workers))
        ):
            await asyncio.sleep(0.005)
    plain = asyncio.ensure_future(_first_chunk_at(stack, "plain", 60))
    while len(queue) < 1:
        await asyncio.sleep(0.002)
    jumped = asyncio.ensure_future(
        _first_chunk_at(stack, "jumped", 60, headers={"x-dynamo-request-priority": "100"})
    )
    while len(queue) < 2:
        await asyncio.sleep(0.002)
    strict = asyncio.ensure_future(
        _first_chunk_at(stack, "strict", 60, nvext={"agent_hints": {"strict_priority": 1}})
    )
    async with asyncio.timeout(10):
        while len(queue) < 3:
            await asyncio.sleep(0.002)
    assert not blocker.done(), "the blocker's prefill ended before the others were held"
    assert _pending((await client.get("/metrics")).text) == {"agg": 3.0}
    # the queue limit: a fourth held request is refused with 529 and an OpenAI error body
    refused = await client.post(
        "/v1/completions", json={"model": "demo", "prompt": "one more", "max_tokens": 2}
    )
    assert refused.status_code == 529, refused.text
    assert refused.json()["error"]["type"] == "overloaded"

    times = await asyncio.wait_for(asyncio.gather(blocker, plain, jumped, strict), 60)
    at = dict(zip(("blocker", "plain", "jumped", "strict"), times, strict=True))
    assert sorted(at, key=at.__getitem__) == ["blocker", "strict", "jumped", "plain"]
    metrics = (await client.get("/metrics")).text
    assert _pending(metrics) == {"agg": 0.0}
    assert re.search(
        r'^dynamo_frontend_router_queue_backpressure_total\{policy_class="default",'
        r'reason="request_limit",worker_type="agg"\} 1\.0$',
        metrics,
        re.M,
    )
    started = re.search(
        r"^dynamo_component_router_requests_started_total\{[^}]*\} (\S+)$", metrics, re.M
    )
    ended = re.search(r"^dynamo_component_router_requests_total\{[^}]*\} (\S+)$", metrics, re.M)
    assert started and float(started.group(1)) == 4.0
    assert ended and float(ended.group(1)) == 4.0
    ttft = re.search(
        r"^dynamo_component_router_time_to_first_token_seconds_count\{[^}]*\} (\S+)$", metrics, re.M
    )
    assert ttft and float(ttft.group(1)) == 4.0


async def test_a_client_that_disconnects_while_held_leaves_the_queue(stack: Stack) -> None:
    await stack.add_worker(*MOCKER)
    client = await stack.start_frontend(router_mode="kv", kv=kv_settings(queue_threshold=0.0))
    await stack.wait_for_model()
    router = _router(stack)
    queue = router.queue
    assert queue is not None
    blocker = asyncio.ensure_future(_first_chunk_at(stack, "blocker", 1000))
    async with asyncio.timeout(10):
        while not router.sequences.active_prefill_tokens(next(iter(router.core.workers))):
            await asyncio.sleep(0.005)
    gone = asyncio.ensure_future(_first_chunk_at(stack, "gone", 60))
    async with asyncio.timeout(10):
        while len(queue) < 1:
            await asyncio.sleep(0.002)
    gone.cancel()  # the client closes its connection while its request is held
    with pytest.raises(asyncio.CancelledError):
        await gone
    async with asyncio.timeout(10):
        while len(queue):
            await asyncio.sleep(0.005)
    await asyncio.wait_for(blocker, 30)
    async with asyncio.timeout(10):  # nothing is left counted on the worker
        while router.sequences.request_ids():
            await asyncio.sleep(0.01)
    assert _pending((await client.get("/metrics")).text) == {"agg": 0.0}
