"""The standalone slot tracker's HTTP API (spec 001), over HTTP against a real subprocess."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.slot_tracker_process import SlotTracker

LLAMA = "llama-3-8b"
I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1


@pytest.fixture(scope="module")
def tracker() -> Iterator[SlotTracker]:
    t = SlotTracker()
    try:
        yield t
    finally:
        assert t.stop() == 0  # SIGTERM is a clean shutdown


def register(t: SlotTracker, model: str, worker: int, **kw: Any) -> httpx.Response:
    body = {"worker_id": worker, "model_name": model, "block_size": 16, "dp_start": 0}
    body |= {"dp_size": 1} | kw
    return t.post("/register", body)


def add(t: SlotTracker, model: str, rid: str, worker: int, hashes: list[int], **kw: Any) -> int:
    body = {"model_name": model, "request_id": rid, "worker_id": worker, "dp_rank": 0}
    resp = t.post("/add", body | {"sequence_hashes": hashes} | kw)
    return resp.status_code


def loads(t: SlotTracker, **params: str) -> list[dict[str, Any]]:
    resp = t.client.get("/loads", params=params)
    assert resp.status_code == 200
    result: list[dict[str, Any]] = resp.json()
    return result


def rank_load(t: SlotTracker, model: str, worker: int, rank: int = 0) -> tuple[int, int]:
    for x in loads(t, model_name=model):
        if x["worker_id"] == worker and x["dp_rank"] == rank:
            return x["active_prefill_tokens"], x["active_decode_blocks"]
    raise AssertionError(f"no load for {model} {worker}/{rank}")


def assert_error(resp: httpx.Response, status: int) -> None:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"]


def test_health_is_200_with_empty_body(tracker: SlotTracker) -> None:
    resp = tracker.client.get("/health")
    assert resp.status_code == 200 and resp.content == b""


def test_spec_example_accounting_and_projection(tracker: SlotTracker) -> None:
    ok = {"status": "ok"}
    assert register(tracker, LLAMA, 7, dp_size=2).json() == ok
    # An earlier request shares two blocks and has finished its prefill.
    assert add(tracker, LLAMA, "req-122", 7, [101, -22], new_isl_tokens=32) == 201
    resp = tracker.post("/prefill_complete", {"model_name": LLAMA, "request_id": "req-122"})
    assert resp.status_code == 200 and resp.json() == ok
    assert add(tracker, LLAMA, "req-123", 7, [101, -22, 303], new_isl_tokens=48) == 201
    assert loads(tracker, model_name=LLAMA) == [
        {
            "model_name": LLAMA,
            "tenant_id": "default",
            "worker_id": 7,
            "dp_rank": 0,
            "active_prefill_tokens": 48,
            "active_decode_blocks": 3,
        },
        {
            "model_name": LLAMA,
            "tenant_id": "default",
            "worker_id": 7,
            "dp_rank": 1,
            "active_prefill_tokens": 0,
            "active_decode_blocks": 0,
        },
    ]
    body = {"model_name": LLAMA, "tenant_id": "default", "new_isl_tokens": 48}
    resp = tracker.post("/potential_loads", body | {"sequence_hashes": [101, -22, 303, 404]})
    assert resp.status_code == 200
    projected = sorted(resp.json(), key=lambda x: x["dp_rank"])  # order is unspecified
    assert projected == [
        {
            "worker_id": 7,
            "dp_rank": 0,
            "potential_prefill_tokens": 96,
            "potential_decode_blocks": 4,
            "active_requests": 2,
        },
        {
            "worker_id": 7,
            "dp_rank": 1,
            "potential_prefill_tokens": 48,
            "potential_decode_blocks": 4,
            "active_requests": 0,
        },
    ]
    # Lifecycle on one rank with overlapping hashes.
    resp = tracker.post("/prefill_complete", {"model_name": LLAMA, "request_id": "req-123"})
    assert resp.status_code == 200 and rank_load(tracker, LLAMA, 7) == (0, 3)
    resp = tracker.post("/prefill_complete", {"model_name": LLAMA, "request_id": "req-123"})
    assert resp.status_code == 200 and rank_load(tracker, LLAMA, 7) == (0, 3)  # repeat: no-op
    assert tracker.post("/free", {"model_name": LLAMA, "request_id": "req-122"}).json() == ok
    assert rank_load(tracker, LLAMA, 7) == (0, 3)  # 101 and -22 still held by req-123
    assert tracker.post("/free", {"model_name": LLAMA, "request_id": "req-123"}).json() == ok
    assert rank_load(tracker, LLAMA, 7) == (0, 0)
    # Free is idempotent while the tracker exists, including for a never-seen request.
    resp = tracker.post("/free", {"model_name": LLAMA, "request_id": "req-123"})
    assert resp.status_code == 200 and resp.json() == ok
    resp = tracker.post("/free", {"model_name": LLAMA, "request_id": "never-added"})
    assert resp.status_code == 200


def test_block_identity_is_positional_as_measured_on_the_reference(tracker: SlotTracker) -> None:
    """FACTS §5.1: the reference's vectors, through the HTTP API."""
    model = "m-trie"
    assert register(tracker, model, 1).status_code == 201

    def decode_blocks(hashes: list[int]) -> int:
        body = {"model_name": model, "sequence_hashes": hashes}
        [proj] = tracker.post("/potential_loads", body).json()
        blocks: int = proj["potential_decode_blocks"]
        return blocks

    assert add(tracker, model, "a", 1, [5, 6, 7]) == 201
    assert [decode_blocks(q) for q in ([9, 6, 7], [5, 7], [5, 6, 7, 5])] == [6, 4, 4]
    assert add(tracker, model, "b", 1, [8, 6]) == 201
    assert rank_load(tracker, model, 1) == (0, 5)
    assert decode_blocks([8, 6, 7]) == 6
    for rid in ("a", "b"):
        assert tracker.post("/free", {"model_name": model, "request_id": rid}).status_code == 200
    assert rank_load(tracker, model, 1) == (0, 0)


def test_free_releases_pending_prefill(tracker: SlotTracker) -> None:
    assert register(tracker, "m-prefill", 1).status_code == 201
    assert add(tracker, "m-prefill", "r", 1, [1, 2], new_isl_tokens=100) == 201
    assert rank_load(tracker, "m-prefill", 1) == (100, 2)
    assert tracker.post("/free", {"model_name": "m-prefill", "request_id": "r"}).status_code == 200
    assert rank_load(tracker, "m-prefill", 1) == (0, 0)


def test_add_defaults_and_empty_hashes(tracker: SlotTracker) -> None:
    assert register(tracker, "m-defaults", 1).status_code == 201
    assert add(tracker, "m-defaults", "empty", 1, []) == 201  # new_isl_tokens defaults to 0
    assert rank_load(tracker, "m-defaults", 1) == (0, 0)
    resp = tracker.post("/potential_loads", {"model_name": "m-defaults", "sequence_hashes": []})
    assert resp.json() == [
        {
            "worker_id": 1,
            "dp_rank": 0,
            "potential_prefill_tokens": 0,
            "potential_decode_blocks": 0,
            "active_requests": 1,
        }
    ]


def test_extreme_hashes_are_accepted_and_shared_prefixes_counted_once(tracker: SlotTracker) -> None:
    model = "m-hashes"
    assert register(tracker, model, 1).status_code == 201
    extremes = [I64_MIN, I64_MAX, -1, 0]
    assert add(tracker, model, "a", 1, extremes) == 201
    assert add(tracker, model, "b", 1, [I64_MIN, I64_MAX, 5]) == 201
    assert rank_load(tracker, model, 1) == (0, 5)  # the first two trie nodes are shared
    body = {"model_name": model, "sequence_hashes": [I64_MIN, I64_MAX, -1, I64_MIN, 6]}
    [proj] = tracker.post("/potential_loads", body).json()
    assert proj["potential_decode_blocks"] == 7 and proj["active_requests"] == 2
    tracker.post("/free", {"model_name": model, "request_id": "a"})
    assert rank_load(tracker, model, 1) == (0, 3)  # b's path: I64_MIN, I64_MAX, 5
    for bad in (I64_MAX + 1, I64_MIN - 1, 1 << 64, 1.5, "1"):
        resp = tracker.post(
            "/add",
            {
                "model_name": model,
                "request_id": f"bad-{bad}",
                "worker_id": 1,
                "dp_rank": 0,
                "sequence_hashes": [bad],
            },
        )
        assert_error(resp, 422)
        assert_error(tracker.post("/potential_loads", body | {"sequence_hashes": [bad]}), 422)
    assert rank_load(tracker, model, 1) == (0, 3)


def test_register_validation_and_scoping(tracker: SlotTracker) -> None:
    model = "m-register"
    assert_error(register(tracker, model, 1, block_size=0), 400)
    assert_error(register(tracker, model, 1, dp_size=0), 400)
    assert_error(register(tracker, model, 1, dp_start=(1 << 32) - 1, dp_size=1), 400)
    assert_error(register(tracker, model, 1, dp_start=(1 << 32) - 3, dp_size=4), 400)
    assert_error(register(tracker, model, 1, dp_start=-1), 422)
    assert_error(register(tracker, model, 1, dp_size=1 << 32), 422)
    assert_error(register(tracker, model, 1, block_size="16"), 422)
    assert_error(tracker.post("/register", {"model_name": model, "worker_id": 1}), 422)
    assert register(tracker, model, 1, dp_start=2, dp_size=2).status_code == 201
    assert_error(register(tracker, model, 1), 409)  # duplicate worker
    assert_error(register(tracker, model, 2, block_size=32), 409)  # one block size per tracker
    # Worker ids are scoped by (model_name, tenant_id); the tenant defaults to "default".
    assert register(tracker, model, 1, tenant_id="t2", block_size=32).status_code == 201
    assert register(tracker, model + "-other", 1).status_code == 201
    assert register(tracker, model, 0, tenant_id="default").status_code == 201
    resp = tracker.client.get("/workers", params={"model_name": model})
    assert resp.json() == [
        {
            "worker_id": 0,
            "model_name": model,
            "tenant_id": "default",
            "block_size": 16,
            "dp_start": 0,
            "dp_size": 1,
        },
        {
            "worker_id": 1,
            "model_name": model,
            "tenant_id": "default",
            "block_size": 16,
            "dp_start": 2,
            "dp_size": 2,
        },
        {
            "worker_id": 1,
            "model_name": model,
            "tenant_id": "t2",
            "block_size": 32,
            "dp_start": 0,
            "dp_size": 1,
        },
    ]
    resp = tracker.client.get("/workers", params={"tenant_id": "t2"})
    assert [(w["model_name"], w["worker_id"]) for w in resp.json()] == [(model, 1)]
    both = {"model_name": model, "tenant_id": "t2"}
    assert len(tracker.client.get("/workers", params=both).json()) == 1
    everything = tracker.client.get("/workers").json()
    keys = [(w["model_name"], w["tenant_id"], w["worker_id"]) for w in everything]
    assert keys == sorted(keys) and len(keys) >= 4
    ranks = [x["dp_rank"] for x in loads(tracker, model_name=model, tenant_id="default")]
    assert ranks == [0, 2, 3]


def test_unregister_removes_requests_and_empty_tracker(tracker: SlotTracker) -> None:
    model = "m-unregister"
    assert register(tracker, model, 1).status_code == 201
    assert register(tracker, model, 2).status_code == 201
    assert add(tracker, model, "r1", 1, [1, 2], new_isl_tokens=8) == 201
    assert add(tracker, model, "r2", 2, [1], new_isl_tokens=8) == 201
    assert_error(tracker.post("/unregister", {"model_name": model, "worker_id": 3}), 404)
    resp = tracker.post("/unregister", {"model_name": model, "worker_id": 1})
    assert resp.status_code == 200 and resp.json() == {"status": "ok"}
    assert [x["worker_id"] for x in loads(tracker, model_name=model)] == [2]
    assert register(tracker, model, 1).status_code == 201
    assert rank_load(tracker, model, 1) == (0, 0)  # re-registered: starts empty
    # r1 went with the worker: a prefill_complete for it is now unknown.
    lifecycle = {"model_name": model, "request_id": "r1"}
    assert_error(tracker.post("/prefill_complete", lifecycle), 404)
    assert tracker.post("/unregister", {"model_name": model, "worker_id": 1}).status_code == 200
    assert tracker.post("/unregister", {"model_name": model, "worker_id": 2}).status_code == 200
    # The last worker took the tracker with it.
    assert_error(tracker.post("/free", lifecycle), 404)
    assert register(tracker, model, 5, block_size=64).status_code == 201  # new block size ok


def test_lifecycle_not_found_and_conflicts(tracker: SlotTracker) -> None:
    model = "m-lifecycle"
    assert register(tracker, model, 1, dp_size=2).status_code == 201
    assert add(tracker, model, "dup", 1, [1]) == 201
    assert add(tracker, model, "dup", 1, [2]) == 409
    assert rank_load(tracker, model, 1) == (0, 1)
    assert add(tracker, model, "x", 9, [1]) == 404  # unknown worker
    assert add(tracker, model, "x", 1, [1], dp_rank=2) == 404  # unknown rank
    assert add(tracker, "m-unknown-model", "x", 1, [1]) == 404  # unknown tracker
    assert add(tracker, model, "x", 1, [1], tenant_id="other") == 404
    for status, body in (
        (404, {"model_name": model, "request_id": "never"}),
        (404, {"model_name": "m-unknown-model", "request_id": "dup"}),
    ):
        assert_error(tracker.post("/prefill_complete", body), status)
    assert_error(tracker.post("/free", {"model_name": "m-unknown-model", "request_id": "x"}), 404)
    assert_error(
        tracker.post("/potential_loads", {"model_name": "m-unknown-model", "sequence_hashes": []}),
        404,
    )
    missing_hashes = {"model_name": model, "request_id": "y", "worker_id": 1, "dp_rank": 0}
    assert_error(tracker.post("/add", missing_hashes), 422)
    assert_error(tracker.post("/add", missing_hashes | {"sequence_hashes": None}), 422)
    assert_error(
        tracker.post("/add", missing_hashes | {"sequence_hashes": [], "new_isl_tokens": -1}), 422
    )


def test_error_statuses_and_bodies(tracker: SlotTracker) -> None:
    client = tracker.client
    json_header = {"content-type": "application/json"}
    assert_error(client.post("/register", content=b"{", headers=json_header), 400)
    assert_error(client.post("/add", content=b"", headers=json_header), 400)
    assert_error(client.post("/add", content=b"[1, 2]", headers=json_header), 422)
    assert_error(client.get("/nope"), 404)
    assert_error(client.post("/loads/", json={}), 404)
    assert_error(client.get("/register"), 405)
    assert_error(client.post("/loads", json={}), 405)
    assert_error(client.put("/add", json={}), 405)
    assert_error(client.post("/add", content=b"{}"), 415)  # no content type
    assert_error(client.post("/add", content=b"{}", headers={"content-type": "text/plain"}), 415)
    ok_type = {"content-type": "application/json; charset=utf-8"}
    body = b'{"model_name":"m-unknown-model","request_id":"r"}'
    assert_error(client.post("/free", content=body, headers=ok_type), 404)  # accepted as JSON
    # Oversized bodies: refused up front from Content-Length, or while streaming a chunked body.
    big = b'{"model_name":"m","sequence_hashes":[' + b"0," * (1 << 20) + b"0]}"
    assert len(big) > 2 * 1024 * 1024
    with httpx.Client(base_url=tracker.url, timeout=10) as fresh:
        assert_error(fresh.post("/potential_loads", content=big, headers=json_header), 413)
    with httpx.Client(base_url=tracker.url, timeout=10) as fresh:
        chunks = (big[i : i + 65536] for i in range(0, len(big), 65536))
        assert_error(fresh.post("/potential_loads", content=chunks, headers=json_header), 413)
    # A large body under the limit, sent chunked, is fine.
    assert register(tracker, "m-big", 1).status_code == 201
    near = b'{"model_name":"m-big","sequence_hashes":[' + b"0," * 200_000 + b"1]}"
    chunked = (near[i : i + 50_000] for i in range(0, len(near), 50_000))
    resp = client.post("/potential_loads", content=chunked, headers=json_header)
    assert resp.status_code == 200 and resp.json()[0]["potential_decode_blocks"] == 200_001
    # Malformed HTTP gets a JSON error and a closed connection.
    with socket.create_connection(("127.0.0.1", int(tracker.url.rsplit(":", 1)[1]))) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 400") and b'{"error":' in reply
    # The service is still healthy and keeps connections alive.
    assert client.get("/health").status_code == 200


def test_peer_routes_without_replica_sync(tracker: SlotTracker) -> None:
    assert tracker.client.get("/peers").json() == []
    assert_error(tracker.post("/register_peer", {"url": "tcp://127.0.0.1:5555"}), 409)
    assert_error(tracker.post("/deregister_peer", {"url": "tcp://127.0.0.1:5555"}), 409)
    assert_error(tracker.post("/register_peer", {"uri": "tcp://127.0.0.1:5555"}), 422)


def test_replica_flags_require_bind() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dynamo.slot_tracker", "--replica-sync-peers", "tcp://x:1"],
        capture_output=True,
        timeout=30,
    )
    assert proc.returncode == 2 and b"require --replica-sync-bind" in proc.stderr
