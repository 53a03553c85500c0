"""Slot tracker replica sync over ZMQ on loopback: two (and three) real processes."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.e2e.slot_tracker_process import SlotTracker

MODEL = "m"
SELF_ADVERTISED = "tcp://slot-tracker-a.invalid:8092"


class Tracker(SlotTracker):
    """A slot tracker with replica sync bound to an ephemeral loopback port."""

    def __init__(self, *args: str) -> None:
        super().__init__("--replica-sync-bind", "tcp://127.0.0.1:*", *args)
        bound = self.line("replica sync bound at ")
        self.endpoint = bound.split()[-1] if bound is not None else ""
        assert self.endpoint.startswith("tcp://127.0.0.1:")

    def register(self, worker: int, model: str = MODEL, **kw: Any) -> None:
        body = {"worker_id": worker, "model_name": model, "block_size": 16, "dp_start": 0}
        resp = self.post("/register", body | {"dp_size": 2} | kw)
        assert resp.status_code == 201, resp.text

    def add(self, rid: str, worker: int, hashes: list[int], model: str = MODEL, **kw: Any) -> None:
        body = {"model_name": model, "request_id": rid, "worker_id": worker, "dp_rank": 0}
        resp = self.post("/add", body | {"sequence_hashes": hashes} | kw)
        assert resp.status_code == 201, resp.text

    def lifecycle(self, op: str, rid: str, model: str = MODEL) -> None:
        resp = self.post(f"/{op}", {"model_name": model, "request_id": rid})
        assert resp.status_code == 200, resp.text

    def load(self, worker: int, rank: int = 0, model: str = MODEL) -> tuple[int, int] | None:
        for x in self.client.get("/loads", params={"model_name": model}).json():
            if x["worker_id"] == worker and x["dp_rank"] == rank:
                return x["active_prefill_tokens"], x["active_decode_blocks"]
        return None

    def peers(self) -> list[str]:
        result: list[str] = self.client.get("/peers").json()
        return result


def eventually(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.05)


def wait_subscribed(src: Tracker, dst: Tracker, worker: int, timeout: float = 15.0) -> None:
    """ZMQ drops what is sent before the subscription is up: probe until one add arrives."""
    deadline = time.monotonic() + timeout
    n = 0
    while True:
        n += 1
        rid = f"probe-{worker}-{n}"
        src.add(rid, worker, [], new_isl_tokens=1, model=MODEL)
        arrived = False
        end = time.monotonic() + 0.3
        while time.monotonic() < end and not arrived:
            arrived = dst.load(worker) == (1, 0)
            time.sleep(0.02)
        src.lifecycle("free", rid)
        if arrived:
            eventually(lambda: dst.load(worker) == (0, 0))
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{dst.url} never received events from {src.endpoint}")


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Tracker, Tracker]]:
    """A and B syncing both ways: B subscribes to A at startup, A to B at runtime."""
    # A's own advertised endpoint in its peer list is skipped (no self-registration).
    a = Tracker(
        "--replica-sync-advertise", SELF_ADVERTISED, "--replica-sync-peers", SELF_ADVERTISED
    )
    b: Tracker | None = None
    try:
        assert a.peers() == []
        b = Tracker("--replica-sync-peers", a.endpoint)
        resp = a.post("/register_peer", {"url": b.endpoint})
        assert resp.status_code == 201 and resp.json() == {"status": "ok"}
        for t in (a, b):
            t.register(1)
            t.register(2)
        wait_subscribed(a, b, 1)
        wait_subscribed(b, a, 2)
        yield a, b
    finally:
        assert a.stop() == 0
        if b is not None:
            assert b.stop() == 0


def test_lifecycle_events_reach_the_peer(pair: tuple[Tracker, Tracker]) -> None:
    a, b = pair
    a.add("r1", 1, [10, -20, 30], new_isl_tokens=48)
    a.add("r2", 1, [10, -20], new_isl_tokens=16)
    eventually(lambda: b.load(1) == (64, 3))
    a.lifecycle("prefill_complete", "r1")
    eventually(lambda: b.load(1) == (16, 3))
    a.lifecycle("free", "r1")
    eventually(lambda: b.load(1) == (16, 2))
    # The other direction.
    b.add("r3", 2, [1 << 62, -(1 << 63)], new_isl_tokens=8)
    eventually(lambda: a.load(2) == (8, 2))
    # A replicated request is held by both: a free on either releases it on both.
    b.lifecycle("free", "r2")
    eventually(lambda: a.load(1) == (0, 0) and b.load(1) == (0, 0))
    b.lifecycle("free", "r3")
    eventually(lambda: a.load(2) == (0, 0))
    # Duplicate-id conflicts stay local: an add of an id the peer already holds is dropped there.
    a.add("dup", 1, [5], new_isl_tokens=4)
    eventually(lambda: b.load(1) == (4, 1))
    for t in (a, b):
        t.lifecycle("free", "dup")
    eventually(lambda: a.load(1) == (0, 0) and b.load(1) == (0, 0))


def test_events_for_unknown_targets_are_dropped(pair: tuple[Tracker, Tracker]) -> None:
    a, b = pair
    # A worker, a rank, a tenant and a block size that only A knows.
    a.register(9)
    a.register(1, model=MODEL, tenant_id="only-a")
    a.register(1, model="sized", block_size=16)
    b.register(1, model="sized", block_size=32)
    a.add("u-worker", 9, [1, 2], new_isl_tokens=5)
    a.add("u-tenant", 1, [1], new_isl_tokens=5, tenant_id="only-a")
    a.add("u-size", 1, [1], new_isl_tokens=5, model="sized")
    a.add("u-rank", 1, [7], new_isl_tokens=5, dp_rank=1)  # known rank: arrives
    eventually(lambda: b.load(1, rank=1) == (5, 1))
    # Everything sent before u-rank has been handled by B by now (one ordered stream).
    assert b.load(9) is None
    assert 9 not in [w["worker_id"] for w in b.client.get("/workers").json()]
    assert b.client.get("/loads", params={"tenant_id": "only-a"}).json() == []
    assert b.load(1, model="sized") == (0, 0)
    assert a.load(9) == (5, 2)  # locally accounted as usual
    a.lifecycle("free", "u-rank")
    eventually(lambda: b.load(1, rank=1) == (0, 0))


def test_peer_registration_rules(pair: tuple[Tracker, Tracker]) -> None:
    a, b = pair
    assert a.peers() == [b.endpoint] and b.peers() == [a.endpoint]
    resp = a.post("/register_peer", {"url": SELF_ADVERTISED})
    assert resp.status_code == 400 and "advertised" in resp.json()["error"]
    resp = a.post("/register_peer", {"url": b.endpoint})  # already registered
    assert resp.status_code == 200 and resp.json() == {"status": "ok"}
    for bad in ("not-a-url", "tcp://127.0.0.1", "tcp://*:5000", "http://127.0.0.1:80", ""):
        resp = a.post("/register_peer", {"url": bad})
        assert resp.status_code == 400 and "error" in resp.json(), bad
    resp = a.post("/deregister_peer", {"url": "tcp://127.0.0.1:1"})
    assert resp.status_code == 404 and "error" in resp.json()


def test_peers_added_and_removed_at_runtime(pair: tuple[Tracker, Tracker]) -> None:
    a, _ = pair
    c = Tracker()
    try:
        assert c.peers() == []
        c.register(1)
        c.register(2)
        resp = c.post("/register_peer", {"url": a.endpoint})
        assert resp.status_code == 201
        extra = "tcp://127.0.0.1:9"  # nothing listens there: ZMQ keeps retrying quietly
        assert c.post("/register_peer", {"url": extra}).status_code == 201
        assert c.peers() == sorted([a.endpoint, extra])
        wait_subscribed(a, c, 1)
        a.add("rt", 1, [1, 2, 3], new_isl_tokens=3)
        eventually(lambda: c.load(1) == (3, 3))
        # Deregistered: A's later events no longer reach C.
        resp = c.post("/deregister_peer", {"url": a.endpoint})
        assert resp.status_code == 200 and resp.json() == {"status": "ok"}
        assert c.peers() == [extra]
        assert c.post("/deregister_peer", {"url": a.endpoint}).status_code == 404
        a.lifecycle("free", "rt")
        a.add("after", 2, [4], new_isl_tokens=2)
        eventually(lambda: a.load(2) == (2, 1))
        time.sleep(1.0)
        assert c.load(1) == (3, 3) and c.load(2) == (0, 0)
        a.lifecycle("free", "after")
        c.lifecycle("free", "rt")
        assert c.load(1) == (0, 0)
    finally:
        assert c.stop() == 0
