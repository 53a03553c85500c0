"""The router queue (FACTS §4.5): ordering per policy, strict tiers, hold and release on
capacity, the queue limit, and cancellation or timeout while held freeing everything."""

from __future__ import annotations

import asyncio
import zlib
from typing import Any

import pytest

from dynamo.protocol.model_card import ModelCard
from dynamo.protocol.request import PreprocessedRequest, RoutingHints
from dynamo.router.config import KVRouterSettings
from dynamo.router.kv_router import KVRouter
from dynamo.router.queue import PendingQueue, QueueFull, QueuePolicy, policy_key
from dynamo.router.waiting import RouterQueue
from dynamo.runtime.context import Context
from dynamo.runtime.errors import Cancelled, Overloaded, ResponseTimeout
from tests.fakes import make_card

BS = 4
CAPACITY = 16  # max_num_batched_tokens of every test worker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _drain_all(q: PendingQueue[str]) -> list[str]:
    out: list[str] = []
    q.drain(lambda _h: True, lambda h: out.append(h.item))
    return out


# -- ordering (PendingQueue) ---------------------------------------------------------------
def test_fcfs_serves_arrival_order_and_a_priority_jump_acts_as_an_earlier_arrival() -> None:
    clock = Clock()
    q: PendingQueue[str] = PendingQueue(QueuePolicy.FCFS, clock=clock)
    for name, jump in (("a", 0.0), ("b", 0.0), ("c", 5.0), ("d", 0.5)):
        q.push(name, priority_jump=jump)
        clock.now += 1.0
    # keys: a 0, b -1, c 5-2=3, d 0.5-3=-2.5
    assert q.items() == ["c", "a", "b", "d"]
    assert _drain_all(q) == ["c", "a", "b", "d"]
    assert len(q) == 0


def test_equal_keys_go_in_arrival_order() -> None:
    q: PendingQueue[str] = PendingQueue(QueuePolicy.FCFS, clock=lambda: 0.0)
    for name in "abcde":
        q.push(name)
    assert _drain_all(q) == list("abcde")


def test_wspt_serves_the_shortest_uncached_work_first_weighted_by_priority() -> None:
    q: PendingQueue[str] = PendingQueue(QueuePolicy.WSPT, clock=lambda: 0.0)
    q.push("long", isl=1000)
    q.push("short", isl=100)
    q.push("mostly_cached", isl=1000, cached_tokens=950)  # 50 uncached
    q.push("long_but_urgent", isl=1000, priority_jump=29.0)  # 30/1000 > 1/50 > 1/100
    assert _drain_all(q) == ["long_but_urgent", "mostly_cached", "short", "long"]
    assert policy_key(
        QueuePolicy.WSPT, priority_jump=0, arrival_offset=0, isl=10, cached_tokens=10
    ) == pytest.approx(1.0)  # nothing uncached: max(1, 0)


def test_lcfs_serves_the_latest_first() -> None:
    clock = Clock()
    q: PendingQueue[str] = PendingQueue(QueuePolicy.LCFS, clock=clock)
    for name in "abc":
        q.push(name)
        clock.now += 1.0
    assert _drain_all(q) == ["c", "b", "a"]


@pytest.mark.parametrize("policy", list(QueuePolicy))
def test_a_higher_strict_tier_always_goes_first(policy: QueuePolicy) -> None:
    clock = Clock()
    q: PendingQueue[str] = PendingQueue(policy, clock=clock)
    q.push("low_but_urgent", priority_jump=1e6, isl=1)
    clock.now += 1.0
    q.push("tier2", strict_priority=2, isl=10_000)
    q.push("tier1", strict_priority=1, isl=1)
    assert _drain_all(q) == ["tier2", "tier1", "low_but_urgent"]


def test_limit_refuses_with_overloaded_and_discard_frees_a_place() -> None:
    q: PendingQueue[str] = PendingQueue(max_requests=2, clock=lambda: 0.0)
    a = q.push("a", isl=10, cached_tokens=4)
    q.push("b", isl=20)
    with pytest.raises(QueueFull) as refused:
        q.push("c")
    assert isinstance(refused.value, Overloaded)  # 529 through the frontend's error mapping
    assert q.rejected == 1
    assert (q.isl_tokens, q.cached_tokens) == (30, 4)
    assert q.discard(a) and not q.discard(a)
    assert (len(q), q.isl_tokens, q.cached_tokens) == (1, 20, 0)
    q.push("c")
    assert _drain_all(q) == ["b", "c"]


def test_drain_stops_at_the_first_request_that_is_not_ready() -> None:
    q: PendingQueue[str] = PendingQueue(clock=lambda: 0.0)
    for name in "abc":
        q.push(name)
    budget = [2]

    def ready(_h: Any) -> bool:
        return budget[0] > 0

    released: list[str] = []

    def release(h: Any) -> None:
        budget[0] -= 1
        released.append(h.item)

    assert q.drain(ready, release) == 2
    assert released == ["a", "b"] and q.items() == ["c"]


def test_a_blocked_front_request_holds_back_later_ready_ones_as_in_the_reference() -> None:
    """Head-of-line: the reference's ``SchedulerQueue::update`` stops at the first request whose
    eligible workers are all busy (a pinned one, say), even when a later one could go."""
    q: PendingQueue[str] = PendingQueue(clock=lambda: 0.0)
    q.push("pinned-to-busy-worker")
    q.push("any-worker")
    released: list[str] = []
    assert q.drain(lambda h: h.item == "any-worker", lambda h: released.append(h.item)) == 0
    assert released == [] and q.items() == ["pinned-to-busy-worker", "any-worker"]


# -- hold and release on capacity (the live router) -----------------------------------------
def _card(worker_id: int, capacity: int | None = CAPACITY) -> ModelCard:
    return make_card(worker_id, namespace="ns", kv_block_size=BS, max_num_batched_tokens=capacity)


def _router(threshold: float | None = 0.5, **settings: Any) -> KVRouter:
    kv = KVRouterSettings(use_kv_events=False, queue_threshold=threshold, **settings)
    return KVRouter(None, "demo", BS, kv)  # type: ignore[arg-type]  # no runtime: nothing started


def _request(rid: str, tokens: int = 12, **hints: Any) -> PreprocessedRequest:
    routing = RoutingHints(**hints) if hints else None
    return PreprocessedRequest(
        model="demo",
        token_ids=[zlib.crc32(rid.encode()) % 1000 * 100 + i for i in range(tokens)],
        request_id=rid,
        routing=routing,
    )


def _one_busy_worker() -> tuple[KVRouter, list[ModelCard], RouterQueue]:
    """A queueing router (threshold 0: any prefill in flight saturates a worker) with one
    worker, busy with the request ``busy``: the next request is held."""
    router = _router(threshold=0.0)
    cards = [_card(1)]
    router.add_worker(cards[0])
    queue = router.queue
    assert queue is not None
    router.select(_request("busy"), cards)
    return router, cards, queue


async def test_held_while_every_worker_is_saturated_and_routed_when_prefill_completes() -> None:
    router = _router()
    cards = [_card(1), _card(2)]
    for card in cards:
        router.add_worker(card)
    queue = router.queue
    assert queue is not None
    # 12 prompt tokens > 0.5 * 16 on a rank: each worker takes one, then both are saturated
    for rid in ("a", "b"):
        assert queue.hold(_request(rid), lambda: cards) is None
        router.select(_request(rid), cards)
    held = queue.hold(_request("c"), lambda: cards)
    assert held is not None and len(queue) == 1
    waiting = asyncio.ensure_future(queue.wait(held, Context(), 10))
    await asyncio.sleep(0)
    assert not waiting.done()
    worker_a = router.sequences.worker_of("a")
    router.on_first_token("a")  # a's prefill is done: its worker has capacity
    selection = await asyncio.wait_for(waiting, 5)
    assert worker_a is not None and selection.instance_id == worker_a[0]
    assert router.sequences.worker_of("c") == worker_a  # routed at release: load counted
    assert len(queue) == 0


async def test_released_in_policy_order_one_capacity_at_a_time() -> None:
    router, cards, queue = _one_busy_worker()
    order: list[str] = []
    waits = []
    for rid, hints in (
        ("plain", {}),
        ("jumped", {"priority_jump": 100.0}),
        ("strict", {"strict_priority": 1}),
    ):
        held = queue.hold(_request(rid, **hints), lambda: cards)
        assert held is not None

        async def wait(held: Any = held, rid: str = rid) -> None:
            await queue.wait(held, Context(), 10)
            order.append(rid)

        waits.append(asyncio.ensure_future(wait()))
    previous = "busy"
    for _ in range(3):
        router.on_first_token(previous)  # one prefill finishes: exactly one request goes
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        previous = order[-1]
        assert len(queue) == 3 - len(order)
    await asyncio.gather(*waits)
    assert order == ["strict", "jumped", "plain"]


async def test_a_worker_without_known_capacity_is_never_saturated() -> None:
    router = _router(threshold=0.0)
    cards = [_card(1, capacity=None)]
    router.add_worker(cards[0])
    assert router.queue is not None
    router.select(_request("a"), cards)
    assert router.queue.hold(_request("b"), lambda: cards) is None


async def test_a_full_queue_refuses_and_a_new_worker_releases_the_held() -> None:
    router = _router(threshold=0.0, queue_max_requests=1)
    cards = [_card(1)]
    router.add_worker(cards[0])
    queue = router.queue
    assert queue is not None
    router.select(_request("busy"), cards)
    held = queue.hold(_request("held"), lambda: cards)
    assert held is not None
    with pytest.raises(QueueFull):
        queue.hold(_request("refused"), lambda: cards)
    assert queue.pending.rejected == 1
    waiting = asyncio.ensure_future(queue.wait(held, Context(), 10))
    cards.append(_card(2))
    router.add_worker(cards[1])  # fresh capacity
    selection = await asyncio.wait_for(waiting, 5)
    assert selection.instance_id == 2


async def test_cancel_while_queued_removes_the_entry_and_holds_nothing() -> None:
    router, cards, queue = _one_busy_worker()
    held = queue.hold(_request("gone"), lambda: cards)
    assert held is not None
    ctx = Context()
    waiting = asyncio.ensure_future(queue.wait(held, ctx, 10))
    await asyncio.sleep(0)
    ctx.stop_generating()  # the client went away
    with pytest.raises(Cancelled):
        await waiting
    assert len(queue) == 0
    router.on_first_token("busy")
    assert router.sequences.worker_of("gone") is None  # never routed, never counted


async def test_a_task_cancelled_after_its_release_frees_the_load_it_was_given() -> None:
    router, cards, queue = _one_busy_worker()
    held = queue.hold(_request("late"), lambda: cards)
    assert held is not None
    waiting = asyncio.ensure_future(queue.wait(held, Context(), 10))
    await asyncio.sleep(0)
    router.on_first_token("busy")  # released: "late" is routed, its load counted ...
    assert router.sequences.worker_of("late") is not None
    waiting.cancel()  # ... but its requester is cancelled before it resumes
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert router.sequences.worker_of("late") is None


async def test_held_past_the_response_timeout_fails_as_a_response_timeout() -> None:
    router, cards, queue = _one_busy_worker()
    held = queue.hold(_request("slow"), lambda: cards)
    assert held is not None
    with pytest.raises(ResponseTimeout):
        await queue.wait(held, Context(), 0.05)
    assert len(queue) == 0


async def test_no_threshold_means_no_queue() -> None:
    assert _router(threshold=None).queue is None


def test_settings_refuse_bad_queue_flags() -> None:
    with pytest.raises(ValueError):
        KVRouterSettings(queue_threshold=-0.1)
    with pytest.raises(ValueError):
        KVRouterSettings(queue_policy="sjf")
    with pytest.raises(ValueError):
        KVRouterSettings(queue_max_requests=0)


def test_flags_reach_the_frontend_through_dynamo_serve_and_have_env_twins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dynamo.frontend.config import FrontendConfig
    from dynamo.serve_args import plan

    p = plan(
        ["--router-mode", "kv", "--router-queue-threshold", "0.5"]
        + ["--router-queue-policy", "wspt", "--router-queue-max-requests", "10"]
    )
    assert "--router-queue-threshold=0.5" in p.frontend_argv
    kv = p.frontend.kv
    assert (kv.queue_threshold, kv.queue_policy, kv.queue_max_requests) == (0.5, "wspt", 10)
    monkeypatch.setenv("DYN_ROUTER_QUEUE_THRESHOLD", "0.25")
    monkeypatch.setenv("DYN_ROUTER_QUEUE_POLICY", "lcfs")
    monkeypatch.setenv("DYN_ROUTER_QUEUE_MAX_REQUESTS", "3")
    kv = plan(["--router-mode", "kv"]).frontend.kv
    assert (kv.queue_threshold, kv.queue_policy, kv.queue_max_requests) == (0.25, "lcfs", 3)
    with pytest.raises(ValueError, match="router-mode kv"):  # a queue only the KV router has
        FrontendConfig(router_mode="round-robin", kv=KVRouterSettings(queue_threshold=0.5))
