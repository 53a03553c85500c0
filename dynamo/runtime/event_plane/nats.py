"""Event plane on NATS core pub/sub (the many-machines shape).

A topic is the subject ``dyn.<namespace>.ev.<topic>``; every message carries a 16-byte header
(publisher id, per-topic seq: the event-plane contract) before the payload. The ``stored_topics``
(KV events) are also kept by JetStream: the stream ``DYN_EV_<namespace>`` captures their core
publishes (publishers pay nothing more), bounded by age and count, and :meth:`replay` reads them
back for a receiver that starts late. NATS subjects match
by whole tokens, not by string prefix, so a subscription takes the namespace's ``>`` and keeps
the topics starting with its prefix: every receiver in a namespace sees its event traffic.
Slow subscribers are dropped from by the client (nats-py's pending limit), never the publisher.
"""

from __future__ import annotations

import logging
import re
import struct
from collections.abc import AsyncIterator

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription as NatsSub
from nats.js import api

from dynamo.runtime.event_plane.base import EventMessage
from dynamo.runtime.naming import new_instance_id

log = logging.getLogger(__name__)

_HEADER = struct.Struct(">QQ")
DEFAULT_PENDING_MSGS = 65_536
STORED_MAX_AGE_S = 3600.0
STORED_MAX_MSGS = 1_000_000
_REPLAY_BATCH = 512
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def stored_stream_name(namespace: str) -> str:
    return "DYN_EV_" + _UNSAFE.sub("_", namespace)


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
        self,
        client: Client,
        namespace: str,
        *,
        stored_topics: tuple[str, ...] = (),
        pending_msgs: int = DEFAULT_PENDING_MSGS,
    ) -> None:
        self._client = client
        self._stored = {topic: topic_subject(namespace, topic) for topic in stored_topics}
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
        if not self._stored:
            return
        config = api.StreamConfig(
            name=stored_stream_name(self._namespace),
            subjects=sorted(self._stored.values()),
            retention=api.RetentionPolicy.LIMITS,
            max_age=STORED_MAX_AGE_S,
            max_msgs=STORED_MAX_MSGS,
            discard=api.DiscardPolicy.OLD,
            storage=api.StorageType.FILE,
        )
        try:
            await self._client.jetstream().add_stream(config)
        except nats.errors.Error as exc:
            # Live delivery does not need the stream: late receivers fall back to asking.
            log.warning("no JetStream stream for stored events (%s)", exc)

    async def replay(self, topic: str) -> AsyncIterator[EventMessage]:
        subject = self._stored.get(topic)
        if subject is None:
            return
        js = self._client.jetstream()
        stream = stored_stream_name(self._namespace)
        try:
            info = await js.stream_info(stream)
            last = int(info.state.last_seq)
            if int(info.state.messages) == 0:
                return
            pull = await js.pull_subscribe(
                subject,
                stream=stream,
                config=api.ConsumerConfig(
                    deliver_policy=api.DeliverPolicy.ALL,
                    ack_policy=api.AckPolicy.NONE,
                    inactive_threshold=30.0,
                ),
            )
        except nats.errors.Error as exc:
            log.warning("cannot replay stored %s events (%s)", topic, exc)
            return
        offset = len(self._base) + 1
        try:
            while True:
                try:
                    msgs = await pull.fetch(_REPLAY_BATCH, timeout=1.0)
                except nats.errors.TimeoutError:
                    return  # nothing more stored
                for msg in msgs:
                    message = decode_message(msg, offset)
                    if message is not None:
                        yield message
                    if msg.metadata.sequence.stream >= last:
                        return
        finally:
            try:
                await pull.unsubscribe()
            except nats.errors.Error:
                pass

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
        # The subscription exists on the server once a round trip has passed. nats-py writes
        # its PING ahead of commands still queued for its flusher (the SUB among them), so the
        # queue is written out first, else the PONG may come back before the server has the SUB.
        await self._client._flush_pending(force_flush=True)  # noqa: SLF001
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
