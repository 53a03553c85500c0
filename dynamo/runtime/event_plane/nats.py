"""Event plane on NATS core pub/sub (the many-machines shape).

A topic is the subject ``dyn.<namespace>.ev.<topic>``; every message carries a 16-byte header
(publisher id, per-topic seq: the event-plane contract) before the payload. NATS subjects match
by whole tokens, not by string prefix, so a subscription takes the namespace's ``>`` and keeps
the topics starting with its prefix: every receiver in a namespace sees its event traffic.
Slow subscribers are dropped from by the client (nats-py's pending limit), never the publisher.
"""

from __future__ import annotations

import logging
import struct

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription as NatsSub

from dynamo.runtime.event_plane.base import EventMessage
from dynamo.runtime.naming import new_instance_id

log = logging.getLogger(__name__)

_HEADER = struct.Struct(">QQ")
DEFAULT_PENDING_MSGS = 65_536


def events_subject_base(namespace: str) -> str:
    return f"dyn.{namespace}.ev"


def topic_subject(namespace: str, topic: str) -> str:
    """The subject of ``topic`` (``.`` would split it into tokens, so it is not allowed)."""
    if not topic or any(c in topic for c in ". *>\t\r\n"):
        raise ValueError(f"invalid event topic {topic!r}")
    return f"{events_subject_base(namespace)}.{topic}"


def decode_message(msg: Msg, subject_offset: int) -> EventMessage | None:
    data = msg.data
    if len(data) < _HEADER.size:
        return None
    publisher_id, seq = _HEADER.unpack_from(data)
    return EventMessage(msg.subject[subject_offset:], publisher_id, seq, data[_HEADER.size :])


class NatsSubscription:
    """The namespace's messages whose topic starts with ``prefix``; malformed ones skipped."""

    def __init__(self, sub: NatsSub, prefix: str, subject_offset: int) -> None:
        self.prefix = prefix
        self._sub = sub
        self._offset = subject_offset
        self._messages = sub.messages
        self._closed = False

    def __aiter__(self) -> NatsSubscription:
        return self

    async def __anext__(self) -> EventMessage:
        while not self._closed:
            msg = await anext(self._messages)  # StopAsyncIteration once unsubscribed
            message = decode_message(msg, self._offset)
            if message is not None and message.topic.startswith(self.prefix):
                return message
        raise StopAsyncIteration

    @property
    def closed(self) -> bool:
        return self._closed

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._sub.unsubscribe()
        except Exception:  # the connection may be closed already
            log.debug("NATS unsubscribe failed", exc_info=True)


class NatsEventPlane:
    """:class:`~dynamo.runtime.event_plane.base.EventPlane` on a NATS connection it does not own
    (the runtime's). ``close()`` closes its subscriptions."""

    def __init__(
        self, client: Client, namespace: str, *, pending_msgs: int = DEFAULT_PENDING_MSGS
    ) -> None:
        self._client = client
        self._namespace = namespace
        self._base = events_subject_base(namespace)
        self._pending_msgs = pending_msgs
        self._publisher_id = new_instance_id()
        self._seqs: dict[str, int] = {}
        self._subjects: dict[str, str] = {}
        self._subscriptions: list[NatsSubscription] = []
        self._closed = False

    @property
    def publisher_id(self) -> int:
        return self._publisher_id

    async def start(self) -> None:
        if self._closed:
            raise RuntimeError("event plane is closed")

    async def publish(self, topic: str, payload: bytes) -> None:
        if self._closed:
            raise RuntimeError("event plane is closed")
        subject = self._subjects.get(topic)
        if subject is None:
            subject = self._subjects[topic] = topic_subject(self._namespace, topic)
        seq = self._seqs.get(topic, 0)
        self._seqs[topic] = seq + 1
        await self._client.publish(subject, _HEADER.pack(self._publisher_id, seq) + payload)

    async def subscribe(self, topic_prefix: str) -> NatsSubscription:
        if self._closed:
            raise RuntimeError("event plane is closed")
        sub = await self._client.subscribe(
            f"{self._base}.>", pending_msgs_limit=self._pending_msgs, pending_bytes_limit=0
        )
        # The subscription exists on the server once a round trip has passed.
        await self._client.flush()
        subscription = NatsSubscription(sub, topic_prefix, len(self._base) + 1)
        self._subscriptions = [s for s in self._subscriptions if not s.closed]
        self._subscriptions.append(subscription)
        return subscription

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for subscription in self._subscriptions:
            await subscription.close()
        self._subscriptions.clear()
