"""LocalEventPlane on a shared LocalEventBus: what only it has (registrations on the bus, its
queue bound's validation). The event-plane contract itself runs against it in
``test_event_plane_contract.py``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from dynamo.runtime.event_plane.base import EventMessage, Subscription
from dynamo.runtime.event_plane.local import LocalEventBus, LocalEventPlane


@pytest.fixture
def bus() -> LocalEventBus:
    return LocalEventBus()


@pytest.fixture
async def planes(bus: LocalEventBus) -> AsyncIterator[tuple[LocalEventPlane, LocalEventPlane]]:
    a, b = LocalEventPlane(bus), LocalEventPlane(bus, max_queue=8)
    await a.start()
    await b.start()
    yield a, b
    await a.close()
    await b.close()


async def recv(sub: Subscription, timeout: float = 2.0) -> EventMessage:
    async with asyncio.timeout(timeout):
        return await anext(aiter(sub))


async def test_close_unregisters_from_the_bus(
    bus: LocalEventBus, planes: tuple[LocalEventPlane, LocalEventPlane]
) -> None:
    _, b = planes
    await b.subscribe("")
    sub = await b.subscribe("t")
    await sub.close()
    assert len(bus._subscriptions) == 1
    await b.close()
    assert bus._subscriptions == []  # nothing left registered on the bus
    with pytest.raises(ValueError):
        LocalEventPlane(bus, max_queue=0)
