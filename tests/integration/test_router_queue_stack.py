"""The router queue through the whole stack (FACTS §4.5): requests held while the worker's
prefill capacity is taken, served in policy order when it frees; the queue gauge on /metrics;
the queue limit's 529; the reference's dynamo_component_router_* families."""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import pytest

from dynamo.protocol.model_card import WorkerRole
from dynamo.router.kv_router import KVRouter
from tests.integration.conftest import Stack, kv_settings

pytestmark = pytest.mark.integration

# One worker; with threshold 0 any prefill in flight saturates it: requests are admitted one
# at a time, each when the previous one's first token comes back.
MOCKER = ("--speedup-ratio", "0", "--block-size", "16", "--max-num-batched-tokens", "2048")
PHANTOM = "phantom"  # a prefill the test puts on the worker's load, and takes off
PENDING = re.compile(
    r'^dynamo_frontend_router_queue_pending_requests\{policy_class="default",'
    r'worker_type="(\w+)"\} ([0-9.]+)$',
    re.M,
)


def _prompt(tag: str, words: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(words))


async def _first_chunk_at(stack: Stack, tag: str, words: int, **extra: object) -> float:
    """Stream a completion (client request id ``tag``); the time its first token arrived."""
    assert stack.client is not None
    headers = {"x-request-id": tag, **extra.pop("headers", {})}  # type: ignore[dict-item]
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


def _saturate(router: KVRouter) -> None:
    """Count a long prefill on the one worker (as if a request were in its prefill): every
    request is held until the test calls ``_release``."""
    worker_id = next(iter(router.core.workers))
    router.sequences.add_request(PHANTOM, worker_id, 0, [], new_isl_tokens=4096)


def _release(router: KVRouter) -> None:
    router.on_first_token(PHANTOM)  # its prefill is over: capacity frees, the queue drains


def _spy_routing_order(router: KVRouter) -> list[str]:
    """The client ids of the requests in the order the router placed them."""
    order: list[str] = []
    select = router.select

    def spy(request: Any, candidates: Any) -> Any:
        order.append((request.request_id or "").rsplit("-", 1)[0])
        return select(request, candidates)

    router.select = spy  # type: ignore[method-assign]
    return order


async def _held(queue: Any, n: int) -> None:
    async with asyncio.timeout(10):
        while len(queue) < n:
            await asyncio.sleep(0.002)


async def test_held_requests_are_served_in_policy_order_and_the_gauge_follows(
    stack: Stack,
) -> None:
    await stack.add_worker(*MOCKER)
    client = await stack.start_frontend(
        router_mode="kv", kv=kv_settings(queue_threshold=0.0, queue_max_requests=3)
    )
    await stack.wait_for_model()
    router = _router(stack)
    queue = router.queue
    assert queue is not None
    metrics = (await client.get("/metrics")).text
    assert _pending(metrics) == {"agg": 0.0}
    assert "dynamo_component_router_requests_started_total{" in metrics  # there from the start
    registered = re.findall(
        r"^dynamo_component_router_worker_registered\{[^}]*\} (\S+)$", metrics, re.M
    )
    assert registered == ["1.0"]  # the one worker's one rank

    order = _spy_routing_order(router)
    _saturate(router)
    plain = asyncio.ensure_future(_first_chunk_at(stack, "plain", 60))
    await _held(queue, 1)
    jumped = asyncio.ensure_future(
        _first_chunk_at(stack, "jumped", 60, headers={"x-dynamo-request-priority": "100"})
    )
    await _held(queue, 2)
    strict = asyncio.ensure_future(
        _first_chunk_at(stack, "strict", 60, nvext={"agent_hints": {"strict_priority": 1}})
    )
    await _held(queue, 3)
    assert _pending((await client.get("/metrics")).text) == {"agg": 3.0}
    # the queue limit: a fourth held request is refused with 529 and an OpenAI error body
    refused = await client.post(
        "/v1/completions", json={"model": "demo", "prompt": "one more", "max_tokens": 2}
    )
    assert refused.status_code == 529, refused.text
    assert refused.json()["error"]["type"] == "overloaded"
    assert not (plain.done() or jumped.done() or strict.done())

    _release(router)
    await asyncio.wait_for(asyncio.gather(plain, jumped, strict), 60)
    assert order == ["strict", "jumped", "plain"]  # strict tier, then the priority jump
    router.on_finish(PHANTOM)
    metrics = (await client.get("/metrics")).text
    assert _pending(metrics) == {"agg": 0.0}
    assert re.search(
        r'^dynamo_frontend_router_queue_backpressure_total\{policy_class="default",'
        r'reason="request_limit",worker_type="agg"\} 1\.0$',
        metrics,
        re.M,
    )
    for family in ("requests_started_total", "requests_total", "time_to_first_token_seconds_count"):
        found = re.search(rf"^dynamo_component_router_{family}\{{[^}}]*\}} (\S+)$", metrics, re.M)
        assert found and float(found.group(1)) == 3.0, family


async def test_a_client_that_disconnects_while_held_leaves_the_queue(stack: Stack) -> None:
    await stack.add_worker(*MOCKER)
    client = await stack.start_frontend(router_mode="kv", kv=kv_settings(queue_threshold=0.0))
    await stack.wait_for_model()
    router = _router(stack)
    queue = router.queue
    assert queue is not None
    _saturate(router)
    gone = asyncio.ensure_future(_first_chunk_at(stack, "gone", 60))
    await _held(queue, 1)
    assert _pending((await client.get("/metrics")).text) == {"agg": 1.0}
    gone.cancel()  # the client closes its connection while its request is held
    with pytest.raises(asyncio.CancelledError):
        await gone
    async with asyncio.timeout(10):
        while len(queue):
            await asyncio.sleep(0.005)
    _release(router)
    router.on_finish(PHANTOM)
    assert router.sequences.request_ids() == []  # the request that left was never placed
    assert _pending((await client.get("/metrics")).text) == {"agg": 0.0}
    later = await _first_chunk_at(stack, "later", 60)  # the worker serves on
    assert later > 0


async def test_a_remote_prefill_waits_in_the_prefill_routers_queue(stack: Stack) -> None:
    """Disaggregated: the prefill workers' router holds a remote prefill while they are
    saturated; the decode workers' router has no queue (no prefill load there)."""
    await stack.add_worker(*MOCKER, "--disaggregation-mode", "prefill")
    await stack.add_worker(*MOCKER, "--disaggregation-mode", "decode")
    client = await stack.start_frontend(router_mode="kv", kv=kv_settings(queue_threshold=0.0))
    await stack.wait_for_model()
    assert stack.frontend is not None
    entry = stack.frontend.registry.get("demo")
    async with asyncio.timeout(10):
        while not entry.live_instance_ids(WorkerRole.PREFILL):
            await asyncio.sleep(0.02)
    prefill, decode = entry.routers[WorkerRole.PREFILL], entry.routers[WorkerRole.DECODE]
    assert isinstance(prefill, KVRouter) and isinstance(decode, KVRouter)
    assert prefill.queue is not None and decode.queue is None
    _saturate(prefill)
    remote = asyncio.ensure_future(_first_chunk_at(stack, "remote", 1200))  # past 1000 tokens
    await _held(prefill.queue, 1)
    assert _pending((await client.get("/metrics")).text) == {"prefill": 1.0}
    _release(prefill)
    await asyncio.wait_for(remote, 30)
    prefill.on_finish(PHANTOM)
    assert _pending((await client.get("/metrics")).text) == {"prefill": 0.0}
