"""NatsEventPlane against a real nats-server: the event-plane contract (prefixes, per-topic seq,
many publishers, close) and a server restart (delivery resumes; the gap shows in seq)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from nats.aio.client import Client as NatsClient

from dynamo.runtime.event_plane.base import EventMessage, Subscription
from dynamo.runtime.event_plane.nats import NatsEventPlane, topic_subject
from dynamo.runtime.nats_client import connect_nats
from tests.servers import NatsServer

MakePlane = Callable[..., Awaitable[NatsEventPlane]]


@pytest.fixture
async def make_plane(nats_server: NatsServer) -> AsyncIterator[MakePlane]:
    """Planes of separate "processes": each with its own NATS connection."""
    created: list[tuple[NatsEventPlane, NatsClient]] = []

    async def make(namespace: str = "test-ns") -> NatsEventPlane:
        client = await connect_nats(nats_server.url)
        plane = NatsEventPlane(client, namespace)
        await plane.start()
        created.append((plane, client))
        return plane

    yield make
    for plane, client in reversed(created):
        await plane.close()
        await client.close()


async def recv(sub: Subscription, timeout: float = 5.0) -> EventMessage:
    async with asyncio.timeout(timeout):
        return await anext(aiter(sub))


def test_topic_subject_rejects_token_separators() -> None:
    assert topic_subject("ns", "kv-events") == "dyn.ns.ev.kv-events"
    for bad in ("", "a.b", "a b", "a*", "a>"):
        with pytest.raises(ValueError):
            topic_subject("ns", bad)


async def test_publish_subscribe_by_prefix_with_seq_per_topic(make_plane: MakePlane) -> None:
    a, b = await make_plane(), await make_plane()
    stranger = await make_plane("other-ns")
    assert a.publisher_id != b.publisher_id
    kv = await b.subscribe("kv")
    everything = await b.subscribe("")
    await stranger.publish("kv-events", b"elsewhere")  # another namespace: never seen
    await a.publish("kv-events", b"1")
    await a.publish("metrics", b"m")
    await a.publish("kv-events", b"2")
    await b.publish("kv-events", b"own")  # a plane also hears itself
    await a.publish("kv_metrics", b"3")
    got = [await recv(kv) for _ in range(4)]
    by_publisher = sorted((m.publisher_id, m.topic, m.seq, m.payload) for m in got)
    assert by_publisher == sorted(
        [
            (a.publisher_id, "kv-events", 0, b"1"),
            (a.publisher_id, "kv-events", 1, b"2"),
            (b.publisher_id, "kv-events", 0, b"own"),
            (a.publisher_id, "kv_metrics", 0, b"3"),
        ]
    )
    # Per publisher and topic, order is kept.
    assert [m.payload for m in got if m.publisher_id == a.publisher_id][:2] == [b"1", b"2"]
    assert sorted([(await recv(everything)).topic for _ in range(5)]) == sorted(
        ["kv-events", "metrics", "kv-events", "kv-events", "kv_metrics"]
    )


async def test_close_ends_iteration_and_stops_delivery(make_plane: MakePlane) -> None:
    a, b = await make_plane(), await make_plane()
    sub = await b.subscribe("t")
    await a.publish("t", b"x")
    assert (await recv(sub)).payload == b"x"
    await sub.close()
    await a.publish("t", b"after")
    assert [m async for m in sub] == []
    await b.close()
    with pytest.raises(RuntimeError):
        await b.publish("t", b"closed")


async def test_nats_restart_delivery_resumes(
    make_plane: MakePlane, nats_server: NatsServer
) -> None:
    publisher, receiver = await make_plane(), await make_plane()
    sub = await receiver.subscribe("kv-events")
    await publisher.publish("kv-events", b"before")
    assert (await recv(sub)).seq == 0
    await asyncio.to_thread(nats_server.restart)
    # Both clients reconnect on their own and the subscription is re-created on the server.
    deadline = asyncio.get_running_loop().time() + 15
    seen: list[EventMessage] = []
    while not seen:
        await publisher.publish("kv-events", b"after")
        try:
            seen.append(await recv(sub, timeout=0.5))
        except TimeoutError:
            assert asyncio.get_running_loop().time() < deadline, "delivery did not resume"
    message = seen[0]
    assert message.payload == b"after" and message.seq >= 1  # a gap, if any, is visible
