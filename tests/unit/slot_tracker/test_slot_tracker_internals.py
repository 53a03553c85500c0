"""Slot tracker internals without sockets: registry replica rules, replica queue, HTTP framing."""

from __future__ import annotations

import argparse

import msgspec
import pytest

from dynamo.runtime.http_json import HttpProtocol
from dynamo.slot_tracker.app import SlotTrackerApp
from dynamo.slot_tracker.config import SlotTrackerConfig, add_arguments, from_args
from dynamo.slot_tracker.registry import Op, Registry, TrackerError
from dynamo.slot_tracker.replica import (
    TOPIC,
    PeerError,
    ReplicaEvent,
    ReplicaSync,
    validate_endpoint,
)
from tests.fakes import FakeTransport

KEY = ("m", "default")


def registry() -> Registry:
    reg = Registry()
    reg.register(KEY, 1, 16, 0, 2)
    return reg


def test_apply_replica_never_creates_and_drops_unknown_targets() -> None:
    reg = registry()
    add = (Op.ADD, "r", 1, 0, [1, 2], 8)
    assert not reg.apply_replica(("other", "default"), 16, *add)  # unknown model
    assert not reg.apply_replica(("m", "t"), 16, *add)  # unknown tenant
    assert not reg.apply_replica(KEY, 32, *add)  # other block size
    assert not reg.apply_replica(KEY, 16, Op.ADD, "r", 9, 0, [1], 8)  # unknown worker
    assert not reg.apply_replica(KEY, 16, Op.ADD, "r", 1, 2, [1], 8)  # unknown rank
    assert reg.list_workers(None, None)[0].worker_id == 1 and len(reg.list_workers(None, None)) == 1
    assert reg.apply_replica(KEY, 16, *add)
    assert not reg.apply_replica(KEY, 16, *add)  # duplicate add
    assert not reg.apply_replica(KEY, 16, Op.FREE, "r", 1, 1, (), 0)  # held on another rank
    assert reg.apply_replica(KEY, 16, Op.PREFILL_COMPLETE, "r", 1, 0, (), 0)
    assert [(x.active_prefill_tokens, x.active_decode_blocks) for x in reg.loads("m", None)] == [
        (0, 2),
        (0, 0),
    ]
    assert reg.apply_replica(KEY, 16, Op.FREE, "r", 1, 0, (), 0)
    assert not reg.apply_replica(KEY, 16, Op.FREE, "r", 1, 0, (), 0)
    assert (reg.replica_applied, reg.replica_dropped) == (3, 8)
    reg.check_invariants()


def test_local_writes_are_published_with_their_worker() -> None:
    published: list[tuple[object, ...]] = []
    reg = registry()
    reg.set_publisher(lambda *event: published.append(event))
    reg.add(KEY, "r", 1, 1, [5], 3)
    reg.prefill_complete(KEY, "r")
    reg.free(KEY, "r")
    reg.free(KEY, "r")  # unknown: nothing to publish
    with pytest.raises(TrackerError) as err:
        reg.prefill_complete(KEY, "r")
    assert err.value.status == 404
    assert [e[2] for e in published] == [Op.ADD, Op.PREFILL_COMPLETE, Op.FREE]
    assert all(e[0] == KEY and e[1] == 16 and e[4:6] == (1, 1) for e in published)
    assert published[0][6] == [5] and published[0][7] == 3


async def test_replica_queue_drops_new_events_when_full_and_ignores_own_origin() -> None:
    reg = registry()
    sync = ReplicaSync(reg, bind="tcp://127.0.0.1:*", queue_size=2)  # not started: nothing drains
    for n in range(4):
        sync.publish(KEY, 16, Op.ADD, f"r{n}", 1, 0, [n], 0)
    assert sync.pending() == 2 and sync.dropped == 2
    encode = msgspec.msgpack.encode
    own = ReplicaEvent(sync.origin, "m", "default", 16, Op.ADD, "x", 1, 0, [1], 4)
    assert not sync.handle_message([TOPIC, encode(own)])
    peer = ReplicaEvent(sync.origin ^ 1, "m", "default", 16, Op.ADD, "x", 1, 0, [1], 4)
    assert not sync.handle_message([b"other-topic", encode(peer)])
    assert not sync.handle_message([TOPIC, b"\xc1garbage"])
    assert not sync.handle_message([TOPIC])
    assert sync.malformed == 3 and sync.received == 0
    assert sync.handle_message([TOPIC, encode(peer)])
    assert reg.loads("m", None)[0].active_prefill_tokens == 4


def test_validate_endpoint() -> None:
    for ok in ("tcp://127.0.0.1:8092", "tcp://host-b:1", "tcp://[::1]:80", "ipc:///tmp/x"):
        validate_endpoint(ok)
    validate_endpoint("tcp://*:8092", bind=True)
    validate_endpoint("tcp://127.0.0.1:*", bind=True)
    for bad in ("tcp://*:8092", "tcp://h:0", "tcp://h:70000", "tcp://h", "udp://h:1", "ipc://"):
        with pytest.raises(PeerError):
            validate_endpoint(bad)


def connection() -> tuple[HttpProtocol, FakeTransport]:
    proto = HttpProtocol(SlotTrackerApp(registry()), 1 << 20, set())
    transport = FakeTransport()
    proto.connection_made(transport)  # type: ignore[arg-type]
    return proto, transport


def test_pipelined_requests_are_answered_in_order() -> None:
    proto, transport = connection()
    body = b'{"model_name":"m","sequence_hashes":[1]}'
    one = b"POST /potential_loads HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    one += b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    proto.data_received(one + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" + one[:30])
    proto.data_received(one[30:])
    replies = bytes(transport.out).split(b"HTTP/1.1 ")[1:]
    assert [r[:3] for r in replies] == [b"200", b"200", b"200"]
    assert b"content-length: 0\r\n" in replies[1] and not transport.closed


def test_head_expect_continue_and_connection_close() -> None:
    proto, transport = connection()
    proto.data_received(b"HEAD /loads HTTP/1.1\r\nHost: x\r\n\r\n")
    assert transport.out.startswith(b"HTTP/1.1 200 OK") and transport.out.endswith(b"\r\n\r\n")
    transport.out.clear()
    body = b'{"model_name":"m","request_id":"q"}'
    head = b"POST /free HTTP/1.1\r\nContent-Type: application/json\r\nExpect: 100-continue\r\n"
    proto.data_received(head + b"Content-Length: %d\r\n\r\n" % len(body))
    assert bytes(transport.out) == b"HTTP/1.1 100 Continue\r\n\r\n"
    proto.data_received(body)
    assert transport.out.endswith(b'{"status":"ok"}')
    transport.out.clear()
    proto.data_received(b"GET /peers HTTP/1.1\r\nConnection: close\r\n\r\n")
    assert b"connection: close" in transport.out and transport.out.endswith(b"[]")
    assert transport.closed


def test_oversized_body_is_refused() -> None:
    proto, transport = connection()
    proto.data_received(b"POST /add HTTP/1.1\r\nContent-Length: 2000000\r\n\r\n")
    assert transport.out.startswith(b"HTTP/1.1 413") and transport.closed
    proto, transport = connection()
    proto.data_received(b"POST /add HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunk = b"80000\r\n" + b"0" * 0x80000 + b"\r\n"  # 512 KiB
    proto.data_received(chunk + chunk)
    assert not transport.out  # exactly at the 1 MiB limit
    proto.data_received(chunk)
    assert transport.out.startswith(b"HTTP/1.1 413") and transport.closed


@pytest.mark.parametrize("limit", [1000, 99_999, 100_000])
def test_declared_length_over_a_small_limit_is_refused_before_continue(limit: int) -> None:
    proto = HttpProtocol(SlotTrackerApp(registry()), limit, set())
    transport = FakeTransport()
    proto.connection_made(transport)  # type: ignore[arg-type]
    head = b"POST /add HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 100000\r\n\r\n"
    proto.data_received(head)
    if limit < 100_000:
        assert transport.out.startswith(b"HTTP/1.1 413") and transport.closed
        assert b"100 Continue" not in transport.out
    else:  # exactly at the limit: the client may send it
        assert bytes(transport.out) == b"HTTP/1.1 100 Continue\r\n\r\n" and not transport.closed


def test_busy_poll_flag() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert from_args(parser.parse_args([])).busy_poll_us == 200
    assert from_args(parser.parse_args(["--busy-poll-us", "0"])).busy_poll_us == 0
    for bad in (-1, 1_000_001):
        with pytest.raises(ValueError):
            SlotTrackerConfig(busy_poll_us=bad)
