"""A frontend and mockers started separately (file discovery, TCP request plane, ZMQ events):
models come and go with their workers, overload (529 + Retry-After), an error after streaming
began (SSE error event + [DONE]), and a client disconnect aborting the engine's request."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgspec
import pytest

from dynamo.protocol.load import WorkerLoad
from dynamo.runtime.config import RuntimeConfig
from dynamo.runtime.runtime import DistributedRuntime
from tests.e2e.frontend.frontend_stack import Stack, request

pytestmark = pytest.mark.e2e

MAX_INFLIGHT = 3
SLOW = ("--speedup-ratio", "0.2")  # ~30 ms per decode pass: requests stay in flight


@pytest.fixture(scope="module")
def fe() -> Iterator[Stack]:
    stack = Stack()
    try:
        stack.frontend(
            "--max-inflight-requests",
            str(MAX_INFLIGHT),
            "--model-retention-secs",
            "60",
            "--log-level",
            "WARNING",
        )
        yield stack
    finally:
        stack.close()


def listed(port: int) -> list[str]:
    status, _, raw = request(port, "GET", "/v1/models")
    assert status == 200, raw
    return [m["id"] for m in json.loads(raw)["data"]]


def wait_until(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def live_instances(port: int, model: str) -> int:
    status, _, raw = request(port, "GET", "/dynamo/alpha/list-models")
    for m in json.loads(raw)["models"]:
        if m["name"] == model:
            return len(m["live_instances"])
    return 0


def metric(port: int, name: str, **labels: str) -> float:
    _, _, raw = request(port, "GET", "/metrics")
    total = 0.0
    for line in raw.decode().splitlines():
        if not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        rest = head[len(name) :]
        if rest and not rest.startswith("{"):
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += float(value)
    return total


def chat(model: str, max_tokens: int = 4, stream: bool = False) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


class SSEClient:
    """A raw streaming request on its own socket, read event by event."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.status = 0
        self.headers: dict[str, str] = {}

    @classmethod
    async def open(
        cls, port: int, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> SSEClient:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        raw = json.dumps(body).encode()
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + f"{extra}content-length: {len(raw)}\r\n\r\n".encode()
            + raw
        )
        await writer.drain()
        self = cls(reader, writer)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        lines = head.decode().split("\r\n")
        self.status = int(lines[0].split()[1])
        for line in lines[1:]:
            if ":" in line:
                k, _, v = line.partition(":")
                self.headers[k.strip().lower()] = v.strip()
        return self

    async def body(self) -> bytes:
        """The rest of a non-chunked reply (error responses)."""
        n = int(self.headers.get("content-length", "0"))
        return await self.reader.readexactly(n)

    async def events(self) -> AsyncIterator[tuple[str | None, str]]:
        """(event name, data) per SSE event; de-chunks HTTP/1.1 chunked encoding."""
        buf = b""
        while True:
            size_line = await asyncio.wait_for(self.reader.readuntil(b"\r\n"), 30)
            size = int(size_line.strip(), 16)
            if size == 0:
                return
            buf += await self.reader.readexactly(size)
            await self.reader.readexactly(2)
            while b"\n\n" in buf:
                raw, buf = buf.split(b"\n\n", 1)
                event: str | None = None
                data = ""
                for line in raw.decode().split("\n"):
                    if line.startswith("event: "):
                        event = line[7:]
                    elif line.startswith("data: "):
                        data = line[6:]
                yield event, data

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


def start_mocker(fe: Stack, model: str, *flags: str) -> Any:
    child = fe.mocker(model, *flags)
    wait_until(lambda: model in listed(fe.port), 20, f"{model} to be listed")
    return child


# -- models come and go with their workers --------------------------------------------------


def test_model_appears_and_disappears(fe: Stack) -> None:
    port = fe.port
    model = "m-life"
    assert model not in listed(port)
    status, _, raw = request(port, "POST", "/v1/chat/completions", chat(model))
    assert status == 404, raw

    first = start_mocker(fe, model, "--speedup-ratio", "0")
    second = fe.mocker(model, "--speedup-ratio", "0")
    wait_until(lambda: live_instances(port, model) == 2, 20, "two live instances")
    status, _, raw = request(port, "GET", f"/v1/models/{model}")
    assert status == 200 and json.loads(raw)["id"] == model
    status, _, raw = request(port, "GET", "/health")
    assert status == 200 and model in {i["model"] for i in json.loads(raw)["instances"]}
    assert metric(port, "dynamo_frontend_model_ready", model=model) == 1.0
    for _ in range(4):
        status, _, raw = request(port, "POST", "/v1/chat/completions", chat(model))
        assert status == 200, raw

    # one of two workers leaves: the model stays, served by the other
    first.signal(signal.SIGTERM)
    assert first.popen.wait(15) == 0
    wait_until(lambda: live_instances(port, model) == 1, 15, "one live instance")
    assert model in listed(port)
    for _ in range(3):
        status, _, raw = request(port, "POST", "/v1/chat/completions", chat(model))
        assert status == 200, raw

    # the last one leaves: gone from the listings, 503 (temporarily unavailable) meanwhile
    second.signal(signal.SIGTERM)
    assert second.popen.wait(15) == 0
    wait_until(lambda: model not in listed(port), 15, f"{model} to leave /v1/models")
    for body in (chat(model), chat(model, stream=True)):
        status, headers, raw = request(port, "POST", "/v1/chat/completions", body)
        assert status == 503, raw
        err = json.loads(raw)["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert "temporarily unavailable" in err["message"]
        assert headers.get("retry-after") is not None
    status, _, _ = request(port, "GET", f"/v1/models/{model}")
    assert status == 404
    assert metric(port, "dynamo_frontend_model_ready", model=model) == 0.0
    status, _, raw = request(port, "GET", "/health")  # no model has a live instance
    assert status == 503 and json.loads(raw)["status"] == "not_ready"
    status, _, _ = request(port, "GET", "/live")
    assert status == 200

    # a worker comes back: the model is served again
    third = start_mocker(fe, model, "--speedup-ratio", "0")
    status, _, raw = request(port, "POST", "/v1/chat/completions", chat(model))
    assert status == 200, raw
    third.stop()


# -- overload --------------------------------------------------------------------------------


async def test_overload_529_with_retry_after(fe: Stack) -> None:
    model = "m-busy"
    mocker = await asyncio.to_thread(start_mocker, fe, model, *SLOW)
    held: list[SSEClient] = []
    try:
        for _ in range(MAX_INFLIGHT):
            c = await SSEClient.open(fe.port, chat(model, max_tokens=2000, stream=True))
            assert c.status == 200
            held.append(c)
        rejected_before = metric(fe.port, "dynamo_frontend_requests_total", error_type="overload")
        for body in (chat(model, stream=True), chat(model), chat("unknown-model")):
            status, headers, raw = await asyncio.to_thread(
                request, fe.port, "POST", "/v1/chat/completions", body
            )
            assert status == 529, raw
            assert headers["retry-after"].isdigit()
            err = json.loads(raw)["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["type"] == "overloaded" and err["code"] == 529
        after = metric(fe.port, "dynamo_frontend_requests_total", error_type="overload")
        assert after == rejected_before + 3
    finally:
        for c in held:
            await c.close()
    # the held requests are aborted: capacity comes back (generous for a loaded machine; the
    # held streams would run a minute)
    deadline = time.monotonic() + 15
    while True:
        status, _, raw = await asyncio.to_thread(
            request, fe.port, "POST", "/v1/chat/completions", chat(model, max_tokens=2)
        )
        if status == 200 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    assert status == 200, raw
    await asyncio.to_thread(mocker.stop)


# -- an error after streaming began ----------------------------------------------------------------


async def test_worker_killed_mid_stream_gives_sse_error_then_done(fe: Stack) -> None:
    model = "m-kill"
    mocker = await asyncio.to_thread(start_mocker, fe, model, *SLOW, "--lease-ttl", "2")
    c = await SSEClient.open(fe.port, chat(model, max_tokens=2000, stream=True))
    try:
        assert c.status == 200
        events: list[tuple[str | None, str]] = []
        killed = False
        async for ev in c.events():
            events.append(ev)
            if not killed and sum(1 for _, d in events if '"content"' in d) >= 3:
                mocker.signal(signal.SIGKILL)
                killed = True
        assert killed
        assert events[-1] == (None, "[DONE]"), events[-3:]
        name, data = events[-2]
        assert name == "error", events[-3:]
        err = json.loads(data)["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert "Traceback" not in data
        # no finish_reason was sent: the stream did not end normally
        assert not any('"finish_reason":"' in d for _, d in events)
    finally:
        await c.close()
        await asyncio.to_thread(mocker.stop)


# -- client disconnect -> abort -> the mocker frees the request's blocks ---------------------------


class LoadWatcher:
    """Follows WorkerLoad messages on the event plane ("kv_metrics"), latest per worker."""

    def __init__(self, discovery_dir: str) -> None:
        self.rt = DistributedRuntime(
            RuntimeConfig(discovery_backend="file", discovery_dir=discovery_dir)
        )
        self.latest: dict[int, WorkerLoad] = {}
        self.changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.rt.start()
        sub = await self.rt.events.subscribe("kv_metrics")
        decoder = msgspec.msgpack.Decoder(WorkerLoad)

        async def follow() -> None:
            async for msg in sub:
                load = decoder.decode(msg.payload)
                self.latest[load.worker_id] = load
                self.changed.set()

        self._sub = sub
        self._task = asyncio.create_task(follow(), name="load-watcher")

    async def wait_for(self, pred: Any, timeout: float) -> WorkerLoad:
        async with asyncio.timeout(timeout):
            while True:
                for load in self.latest.values():
                    if pred(load):
                        return load
                self.changed.clear()
                await self.changed.wait()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._sub.close()
        await self.rt.shutdown()


async def _freed_within(watcher: LoadWatcher, worker: int, limit_s: float) -> None:
    """The worker reports no running request and no active decode blocks within ``limit_s``."""
    try:
        await watcher.wait_for(
            lambda w: w.worker_id == worker and w.num_running == 0 and w.active_decode_blocks == 0,
            limit_s,
        )
    except TimeoutError:
        raise AssertionError(
            f"the worker's load did not drop to idle within {limit_s} s after the client left: "
            f"{watcher.latest.get(worker)}"
        ) from None


FREED_WITHIN_S = 10.0
"""Generous for a loaded machine (a hop to the worker, its abort, its load on the event plane);
the request it aborts would run for minutes."""


async def counted_disconnects(port: int, expected: float) -> None:
    """Until the frontend counts ``expected`` disconnected clients, then exactly that many: the
    worker's idle load can reach the test before the frontend has read the aborted stream's
    end (which is when it counts the disconnect)."""
    name = "dynamo_frontend_disconnected_clients"
    async with asyncio.timeout(10):
        while (got := await asyncio.to_thread(metric, port, name)) < expected:
            await asyncio.sleep(0.05)
    assert got == expected


async def test_disconnect_aborts_and_frees_blocks(fe: Stack) -> None:
    model = "m-disc"
    watcher = LoadWatcher(fe.discovery_dir)
    await watcher.start()
    mocker = await asyncio.to_thread(start_mocker, fe, model, *SLOW)
    before = await asyncio.to_thread(metric, fe.port, "dynamo_frontend_disconnected_clients")
    try:
        # streaming: the client closes the connection after a few chunks
        c = await SSEClient.open(fe.port, chat(model, max_tokens=4000, stream=True))
        assert c.status == 200
        seen = 0
        async for _, data in c.events():
            seen += '"content"' in data
            if seen >= 3:
                break
        busy = await watcher.wait_for(lambda w: w.num_running == 1, 10)
        assert busy.active_decode_blocks > 0
        await c.close()
        await _freed_within(watcher, busy.worker_id, FREED_WITHIN_S)
        await counted_disconnects(fe.port, before + 1)

        # unary: the client gives up while the response is being generated
        reader, writer = await asyncio.open_connection("127.0.0.1", fe.port)
        raw = json.dumps(chat(model, max_tokens=4000)).encode()
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
            + f"content-type: application/json\r\ncontent-length: {len(raw)}\r\n\r\n".encode()
            + raw
        )
        await writer.drain()
        busy = await watcher.wait_for(lambda w: w.num_running == 1, 10)
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        await _freed_within(watcher, busy.worker_id, FREED_WITHIN_S)
        await counted_disconnects(fe.port, before + 2)
        ok, counts = await asyncio.to_thread(_frontend_counts, fe.port, model)
        assert ok, counts
    finally:
        await watcher.close()
        await asyncio.to_thread(mocker.stop)


async def test_disconnect_cancels_only_its_own_request_despite_a_shared_request_id(
    fe: Stack,
) -> None:
    """Two clients send the same x-request-id; one leaves: the other's stream is unaffected."""
    model = "m-dup"
    mocker = await asyncio.to_thread(start_mocker, fe, model, *SLOW)
    headers = {"x-request-id": "dup-id"}
    try:
        leaver = await SSEClient.open(fe.port, chat(model, max_tokens=40, stream=True), headers)
        stayer = await SSEClient.open(fe.port, chat(model, max_tokens=40, stream=True), headers)
        assert leaver.headers["x-request-id"] == stayer.headers["x-request-id"] == "dup-id"
        seen = 0
        async for _, data in leaver.events():
            seen += '"content"' in data
            if seen >= 3:
                break
        await leaver.close()
        events = [ev async for ev in stayer.events()]
        await stayer.close()
        assert events[-1] == (None, "[DONE]")
        assert not any(name == "error" for name, _ in events), events[-3:]
        assert '"finish_reason":"length"' in events[-2][1]
        assert all('"id":"chatcmpl-dup-id"' in d for _, d in events[:-1])
    finally:
        await asyncio.to_thread(mocker.stop)


def _frontend_counts(port: int, model: str) -> tuple[bool, str]:
    """The cancelled requests are accounted: errors with error_type cancelled, none in flight."""
    cancelled = metric(port, "dynamo_frontend_requests_total", model=model, error_type="cancelled")
    active = metric(port, "dynamo_frontend_active_requests", model=model)
    return cancelled == 2.0 and active == 0.0, f"cancelled={cancelled} active={active}"
