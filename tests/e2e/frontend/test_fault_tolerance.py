"""Fault tolerance with real processes (file discovery, TCP request plane): two frontends over
the same mocker workers, one migrating (``--migration-limit 3``, short response timeouts), one
not (``--migration-limit 0``). A worker SIGKILLed, SIGSTOPped or SIGTERMed mid-stream.

The mocker's ids depend only on (seed, position), so a migrated stream must read exactly like an
uninterrupted run of the same request."""

from __future__ import annotations

import http.client
import json
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest

from tests.e2e.frontend.frontend_stack import Child, Stack, request, wait_instances

pytestmark = pytest.mark.e2e

MODEL = "ft-model"
MAX_TOKENS = 240
STREAMS = 8


@dataclass
class StreamResult:
    text: str = ""
    completion_tokens: int | None = None
    errors: list[str] = field(default_factory=list)
    done: int = 0
    status: int = 0


@dataclass
class Fleet:
    stack: Stack
    migrating: int  # frontend ports
    plain: int
    workers: list[Child]

    def start_worker(self) -> Child:
        child = self.stack.mocker(
            MODEL, "--speedup-ratio", "1", "--graceful-shutdown-timeout", "0.3"
        )
        self.workers.append(child)
        return child

    def ensure_workers(self, n: int = 2) -> None:
        self.workers = [w for w in self.workers if w.popen.poll() is None]
        while len(self.workers) < n:
            self.start_worker()
        for port in (self.migrating, self.plain):
            wait_instances(port, n)


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    stack = Stack()
    try:
        stack.frontend(
            "--migration-limit",
            "3",
            "--first-response-timeout-secs",
            "3",
            "--inter-chunk-timeout-secs",
            "1.5",
            "--instance-probe-interval-secs",
            "0.5",
            "--log-level",
            "WARNING",
        )
        migrating = stack.port
        stack.frontend("--migration-limit", "0", "--log-level", "WARNING")
        fleet = Fleet(stack, migrating, stack.port, [])
        fleet.ensure_workers()
        yield fleet
    finally:
        for child in stack.children:  # a stopped worker must run to handle SIGTERM
            child.signal(signal.SIGCONT)
        stack.close()


def body(seed: int, max_tokens: int = MAX_TOKENS) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"tell me a long story number {seed}"}],
        "max_tokens": max_tokens,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def run_stream(port: int, payload: dict[str, object], started: threading.Event) -> StreamResult:
    """One SSE stream, read to its end; ``started`` is set at the first content."""
    out = StreamResult()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            body=json.dumps(payload).encode(),
            headers={"content-type": "application/json"},
        )
        resp = conn.getresponse()
        out.status = resp.status
        if resp.status != 200:
            out.errors.append(resp.read().decode())
            return out
        event = "message"
        for raw in resp:
            line = raw.decode().rstrip("\n")
            if line.startswith("event:"):
                event = line.split(":", 1)[1].strip()
            elif line.startswith("data: "):
                data = line[6:]
                if data == "[DONE]":
                    out.done += 1
                elif event == "error":
                    out.errors.append(data)
                else:
                    chunk = json.loads(data)
                    if chunk.get("usage"):
                        out.completion_tokens = chunk["usage"]["completion_tokens"]
                    for choice in chunk.get("choices", []):
                        out.text += choice["delta"].get("content") or ""
                        started.set()
            elif not line:
                event = "message"
    finally:
        conn.close()
    return out


def run_many(port: int, seeds: list[int], fault: object = None) -> list[StreamResult]:
    """``len(seeds)`` concurrent streams; ``fault()`` runs once all have started streaming."""
    events = [threading.Event() for _ in seeds]
    with ThreadPoolExecutor(len(seeds)) as pool:
        futures = [
            pool.submit(run_stream, port, body(s), e) for s, e in zip(seeds, events, strict=True)
        ]
        if fault is not None:
            for e in events:
                assert e.wait(30), "a stream never started"
            time.sleep(0.3)  # well into the streams
            fault()  # type: ignore[operator]
        return [f.result(timeout=90) for f in futures]


def uninterrupted(port: int, seeds: list[int]) -> list[str]:
    results = run_many(port, seeds)
    assert all(r.errors == [] and r.completion_tokens == MAX_TOKENS for r in results)
    return [r.text for r in results]


def migrations(port: int) -> float:
    _, _, raw = request(port, "GET", "/metrics")
    total = 0.0
    for line in raw.decode().splitlines():
        if line.startswith("dynamo_frontend_model_migration_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def assert_complete(results: list[StreamResult], expected: list[str]) -> None:
    for r, text in zip(results, expected, strict=True):
        assert r.status == 200 and r.errors == [], r.errors
        assert r.done == 1
        assert r.completion_tokens == MAX_TOKENS
        assert r.text == text, "a migrated stream must read like an uninterrupted one"


def test_sigkill_mid_stream_migrates_every_stream(fleet: Fleet) -> None:
    seeds = list(range(100, 100 + STREAMS))
    expected = uninterrupted(fleet.migrating, seeds)
    before = migrations(fleet.migrating)
    victim = fleet.workers[0]
    results = run_many(fleet.migrating, seeds, lambda: victim.signal(signal.SIGKILL))
    assert_complete(results, expected)
    assert migrations(fleet.migrating) > before, "the kill hit streams in flight"
    fleet.ensure_workers()


def test_sigkill_without_migration_fails_loudly_and_fails_over(fleet: Fleet) -> None:
    seeds = list(range(200, 200 + STREAMS))
    victim = fleet.workers[0]
    results = run_many(fleet.plain, seeds, lambda: victim.signal(signal.SIGKILL))
    failed = [r for r in results if r.errors]
    assert failed, "the kill hit streams in flight"
    for r in results:
        assert r.done == 1
        if not r.errors:
            assert r.completion_tokens == MAX_TOKENS, "never a silently short stream"
    # Right after the kill (the dead worker's lease has not expired: discovery still lists
    # it), every new request succeeds: the dead instance is out of routing already.
    after = [
        request(fleet.plain, "POST", "/v1/chat/completions", body(i, 4) | {"stream": False})
        for i in range(8)
    ]
    assert [status for status, _, _ in after] == [200] * 8, [b[:200] for _, _, b in after]
    fleet.ensure_workers()


def test_sigstop_mid_stream_is_detected_by_the_timeouts_and_migrates(fleet: Fleet) -> None:
    seeds = list(range(300, 300 + STREAMS))
    expected = uninterrupted(fleet.migrating, seeds)
    victim = fleet.workers[0]
    before = migrations(fleet.migrating)
    started = time.monotonic()
    try:
        results = run_many(fleet.migrating, seeds, lambda: victim.signal(signal.SIGSTOP))
        assert_complete(results, expected)
        assert time.monotonic() - started < 30
        assert migrations(fleet.migrating) > before
    finally:
        victim.signal(signal.SIGCONT)
    victim.stop()
    fleet.ensure_workers()


def test_sigterm_under_load_loses_no_request(fleet: Fleet) -> None:
    seeds = list(range(400, 400 + STREAMS))
    expected = uninterrupted(fleet.migrating, seeds)
    victim = fleet.workers[0]
    results = run_many(fleet.migrating, seeds, lambda: victim.signal(signal.SIGTERM))
    assert_complete(results, expected)
    assert victim.popen.wait(20) == 0
    fleet.ensure_workers()
