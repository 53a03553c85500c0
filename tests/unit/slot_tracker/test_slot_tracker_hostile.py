"""The slot tracker against malformed and hostile input over real loopback HTTP: every bad body
is a 4xx with the spec's ``{"error": ...}`` shape (invalid UTF-8, JSON nested 100k levels,
65-bit integers, a client that half-closes mid-body), and a seeded, time-bounded fuzz of every
route never sees a 5xx."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from dynamo.runtime.http_limits import HttpLimits
from dynamo.slot_tracker.config import SlotTrackerConfig
from dynamo.slot_tracker.service import SlotTrackerService

ROUTES = [
    "/register",
    "/unregister",
    "/add",
    "/prefill_complete",
    "/free",
    "/potential_loads",
    "/register_peer",
    "/deregister_peer",
]
FIELDS = [
    "worker_id",
    "model_name",
    "block_size",
    "dp_start",
    "dp_size",
    "tenant_id",
    "request_id",
    "dp_rank",
    "sequence_hashes",
    "new_isl_tokens",
    "url",
]


class Tracker:
    """A slot tracker service on its own loop in a thread (the test client is synchronous)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        limits = HttpLimits(body_timeout_s=0.5, header_timeout_s=0.5)
        self.service = SlotTrackerService(
            SlotTrackerConfig(host="127.0.0.1", port=0, limits=limits)
        )
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.service.start(), self.loop).result(10)
        self.port = self.service.port
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=10)

    def post(self, path: str, body: bytes) -> httpx.Response:
        return self.client.post(path, content=body, headers={"content-type": "application/json"})

    def close(self) -> None:
        self.client.close()
        asyncio.run_coroutine_threadsafe(self.service.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def tracker() -> Iterator[Tracker]:
    t = Tracker()
    try:
        yield t
    finally:
        t.close()


def assert_spec_error(resp: httpx.Response) -> None:
    assert 400 <= resp.status_code < 500, (resp.status_code, resp.text)
    body = resp.json()
    assert isinstance(body, dict) and isinstance(body.get("error"), str), resp.text


@pytest.mark.parametrize("route", ROUTES)
def test_invalid_utf8_in_a_string_is_400(tracker: Tracker, route: str) -> None:
    resp = tracker.post(route, b'{"model_name":"m\xff\xfe","request_id":"r","url":"\xc3"}')
    assert_spec_error(resp)
    assert resp.status_code == 400


@pytest.mark.parametrize("route", ROUTES)
def test_deeply_nested_json_is_400(tracker: Tracker, route: str) -> None:
    depth = 100_000
    nested = b"[" * depth + b"]" * depth
    for body in (nested, b'{"model_name":"m","sequence_hashes":' + nested + b"}"):
        resp = tracker.post(route, body)
        assert_spec_error(resp)


@pytest.mark.parametrize("field", ["worker_id", "dp_rank", "new_isl_tokens", "sequence_hashes"])
def test_65_bit_integers_are_4xx(tracker: Tracker, field: str) -> None:
    big = 1 << 65
    body: dict[str, Any] = {
        "model_name": "m",
        "request_id": "r",
        "worker_id": 1,
        "dp_rank": 0,
        "sequence_hashes": [1, 2],
    }
    body[field] = [big] if field == "sequence_hashes" else big
    for route in ("/add", "/potential_loads"):
        assert_spec_error(tracker.post(route, json.dumps(body).encode()))


def test_half_close_mid_body_frees_the_connection(tracker: Tracker) -> None:
    with socket.create_connection(("127.0.0.1", tracker.port), timeout=5) as sock:
        sock.sendall(
            b"POST /add HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
            b'content-length: 100\r\n\r\n{"model'
        )
        sock.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := sock.recv(4096):  # answered (408 after the body timeout) or just closed
            data += chunk
        assert not data.startswith(b"HTTP/1.1 5"), data
    assert tracker.client.get("/health").status_code == 200


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=12,
)
bodies = st.one_of(
    st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=8).map(
        lambda d: json.dumps(d).encode()
    ),
    st.binary(max_size=64),
    json_values.map(lambda v: json.dumps(v).encode()),
)


@seed(12)
@settings(
    max_examples=150,
    deadline=None,
    derandomize=False,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(route=st.sampled_from(ROUTES), body=bodies)
def test_fuzzed_bodies_never_get_5xx(tracker: Tracker, route: str, body: bytes) -> None:
    resp = tracker.post(route, body)
    assert resp.status_code < 500, (route, body, resp.status_code, resp.text)
    if resp.status_code >= 400:
        assert_spec_error(resp)
