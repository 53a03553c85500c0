"""Where a migrated continuation goes (``frontend/placement.py``): away from an instance with a
new request's prefill pending; then the KV router's cost, or (round-robin, random) the instance
with the fewest of this frontend's streams; and the stream counts the attempts keep."""

from __future__ import annotations

import msgspec
import pytest

from dynamo.frontend.placement import InstanceStreams, continuation_candidates
from dynamo.protocol.request import PreprocessedRequest, RoutingHints
from dynamo.router.basic import RoundRobinRouter
from dynamo.router.config import KVRouterSettings
from dynamo.router.kv_router import KVRouter
from dynamo.runtime.errors import StreamIncomplete
from tests.unit.frontend.handler_kit import TEXT6, Script, card, make_kit
from tests.unit.frontend.test_migration import STREAM, kit_with, streamed_text

pytestmark = pytest.mark.unit

CARDS = [card(1), card(2), card(3)]
REQUEST = PreprocessedRequest(model="demo", token_ids=list(range(100)), request_id="r")


def ids(cards: list[object]) -> list[int]:
    return [c.instance_id for c in cards]  # type: ignore[attr-defined]


def streams_with(active: dict[int, int], prefilling: dict[int, int]) -> InstanceStreams:
    s = InstanceStreams()
    for instance, n in active.items():
        for i in range(n):
            s.dispatched(instance, new_request=i < prefilling.get(instance, 0))
    return s


def test_the_counts_follow_attempts_and_leave_nothing_behind() -> None:
    s = InstanceStreams()
    s.dispatched(1, new_request=True)
    s.dispatched(1, new_request=False)  # a continuation: not a pending new prefill
    assert s.active == {1: 2} and s.prefilling == {1: 1}
    s.first_token(1)
    assert s.prefilling == {}
    s.ended(1, prefilling=False)
    s.dispatched(2, new_request=True)
    s.ended(2, prefilling=True)  # failed before its first token
    s.ended(1, prefilling=False)
    assert s.active == {} and s.prefilling == {}


def test_round_robin_avoids_a_prefill_then_takes_the_fewest_streams() -> None:
    rr = RoundRobinRouter()
    # 3 is mid-prefill; of 1 and 2, 2 has fewer streams.
    s = streams_with({1: 8, 2: 7, 3: 6}, {3: 1})
    assert ids(continuation_candidates(rr, REQUEST, CARDS, s)) == [2]
    # Equal streams: every tie stays, the router's own order picks among them.
    s = streams_with({1: 7, 2: 7, 3: 6}, {3: 1})
    assert ids(continuation_candidates(rr, REQUEST, CARDS, s)) == [1, 2]
    # Everybody prefilling: no instance is avoided, load decides.
    s = streams_with({1: 8, 2: 7, 3: 6}, {1: 1, 2: 1, 3: 1})
    assert ids(continuation_candidates(rr, REQUEST, CARDS, s)) == [3]


def test_continuations_do_not_count_as_a_prefill_to_avoid() -> None:
    s = InstanceStreams()
    for instance in (1, 2, 3):
        for _ in range(8):
            s.dispatched(instance, new_request=False)
    s.dispatched(1, new_request=False)  # continuations just placed on 1 and 2
    s.dispatched(2, new_request=False)
    assert ids(continuation_candidates(RoundRobinRouter(), REQUEST, CARDS, s)) == [3]


def test_a_pinned_request_keeps_its_candidates() -> None:
    pinned = PreprocessedRequest(
        model="demo", token_ids=[1], routing=RoutingHints(backend_instance_id=3)
    )
    s = streams_with({1: 1, 2: 1, 3: 9}, {3: 1})
    assert ids(continuation_candidates(RoundRobinRouter(), pinned, CARDS, s)) == [1, 2, 3]


def test_the_kv_router_scores_every_instance_not_prefilling() -> None:
    kv = KVRouter(None, "demo", 16, KVRouterSettings())  # type: ignore[arg-type]
    s = streams_with({1: 1, 2: 9, 3: 1}, {1: 1})
    assert ids(continuation_candidates(kv, REQUEST, CARDS, s)) == [2, 3]


def test_kv_continuations_of_one_burst_see_each_other() -> None:
    """The dead worker is gone from the KV router's load; each continuation placed counts its
    prefill tokens, so the next one of the same burst goes elsewhere."""
    kv = KVRouter(None, "demo", 16, KVRouterSettings())  # type: ignore[arg-type]
    cards = [msgspec.structs.replace(c, data_parallel_size=1) for c in CARDS]
    for c in cards:
        kv.add_worker(c)
    kv.remove_worker(1)  # report_down of the killed worker
    live = cards[1:]
    a = PreprocessedRequest(model="demo", token_ids=[7] * 160, request_id="a")
    b = PreprocessedRequest(model="demo", token_ids=[9] * 160, request_id="b")
    first, second = kv.select(a, live), kv.select(b, live)
    assert {first.instance_id, second.instance_id} == {2, 3}


async def test_a_migrated_stream_avoids_the_instance_prefilling() -> None:
    kit = kit_with(Script(fail=StreamIncomplete("cut"), fail_after=3, failing_streams=1))
    kit.worker.ids = [1, 2, 3]
    entry = kit.handler._registry.get("demo")  # type: ignore[attr-defined]
    entry.put_card(card(3))
    # Other requests: a prefill pending on 3, two streams decoding on 2 (by streams alone, and
    # by the router's order, the continuation would go to 3).
    entry.streams.dispatched(3, new_request=True)
    entry.streams.dispatched(2, new_request=False)
    entry.streams.dispatched(2, new_request=False)
    http = await kit.call(STREAM)
    assert streamed_text(http.text)[0] == TEXT6
    assert kit.worker.targets == [1, 2]
    # Every attempt's counts went when it ended; only the other requests' remain.
    assert entry.streams.active == {2: 2, 3: 1} and entry.streams.prefilling == {3: 1}


async def test_a_completed_request_leaves_no_count() -> None:
    kit = make_kit()
    http = await kit.call(STREAM)
    assert http.status == 200
    entry = kit.handler._registry.get("demo")  # type: ignore[attr-defined]
    assert entry.streams.active == {} and entry.streams.prefilling == {}
