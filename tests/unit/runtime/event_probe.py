"""Receiving helpers shared by the event-plane tests: bounded receives, and connection probes
that wait out ZMQ's slow joiner (local and NATS deliver the first probe)."""

from __future__ import annotations

import asyncio

from dynamo.runtime.event_plane.base import EventMessage, EventPlane, Subscription

PROBE = "#probe"  # suffix of connection-probe topics (their seq is their own)


async def recv(sub: Subscription, timeout: float = 5.0) -> EventMessage:
    async with asyncio.timeout(timeout):
        return await anext(aiter(sub))


async def recv_data(sub: Subscription, timeout: float = 5.0) -> EventMessage:
    """The next message that is not a connection probe."""
    while (message := await recv(sub, timeout)).topic.endswith(PROBE):
        pass
    return message


async def wait_connected(publisher: EventPlane, sub: Subscription, prefix: str) -> None:
    """Publish probes (on a topic ``sub`` matches: ``prefix`` + PROBE) until one reaches it."""
    topic = prefix + PROBE
    async with asyncio.timeout(15.0):
        while True:
            await publisher.publish(topic, b"")
            try:
                async with asyncio.timeout(0.05):
                    while True:
                        message = await anext(aiter(sub))
                        if (
                            message.topic == topic
                            and message.publisher_id == publisher.publisher_id
                        ):
                            return
            except TimeoutError:
                continue
