"""NatsEventPlane against a real nats-server: what only NATS has (topic subjects, namespaces as
subjects, a server restart: delivery resumes and the gap shows in seq). The event-plane
contract itself runs against it in ``test_event_plane_contract.py``."""

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


async def test_another_namespace_is_never_heard(make_plane: MakePlane) -> None:
    a, stranger = await make_plane(), await make_plane("other-ns")
    sub = await a.subscribe("")
    await stranger.publish("kv-events", b"elsewhere")
    await a.publish("kv-events", b"here")
    assert (await recv(sub)).payload == b"here"
    with pytest.raises(TimeoutError):
        await recv(sub, timeout=0.3)


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
