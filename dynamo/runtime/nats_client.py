"""The one NATS connection of a process (event plane and JetStream work queues share it).

nats-py reconnects on its own, forever, and re-creates subscriptions after a reconnect;
publishes made while disconnected are buffered (up to ``pending_size``) and flushed after it.
Messages others published meanwhile are lost to core subscribers: receivers see the gap in the
publisher's ``seq`` (the event-plane contract), and KV events can be re-read from JetStream.
"""

from __future__ import annotations

import logging

import nats
from nats.aio.client import Client

from dynamo.runtime.errors import CannotConnect

log = logging.getLogger(__name__)


def nats_servers(text: str) -> list[str]:
    """``nats://a:4222,nats://b:4222`` -> the list nats-py takes."""
    servers = [s.strip() for s in text.split(",") if s.strip()]
    if not servers:
        raise ValueError("no NATS server given")
    return servers


async def connect_nats(servers: str, *, name: str = "dynamo") -> Client:
    """Connect (raising ``CannotConnect`` if no server answers now), then stay connected."""

    async def on_error(exc: Exception) -> None:
        if isinstance(exc, nats.errors.SlowConsumerError):
            log.debug("NATS: %s", exc)  # a receiver fell behind: one message dropped
        else:
            log.warning("NATS: %s", exc)

    async def on_disconnected() -> None:
        log.info("NATS disconnected")

    async def on_reconnected() -> None:
        log.info("NATS reconnected")

    try:
        return await nats.connect(
            servers=nats_servers(servers),
            name=name,
            connect_timeout=5,
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.25,
            # A dead server (its host gone, no FIN) is noticed after ~2 missed pings.
            ping_interval=5,
            max_outstanding_pings=2,
            error_cb=on_error,
            disconnected_cb=on_disconnected,
            reconnected_cb=on_reconnected,
        )
    except Exception as exc:  # nats-py raises several unrelated types on connect
        raise CannotConnect(f"NATS unreachable at {servers}: {exc}") from exc
