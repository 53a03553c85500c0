"""The bench's HTTP/1.1 + SSE client: framing split at every byte boundary, keep-alive reuse,
stale-connection retry, timeouts, and the OpenAI stream recorder."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from dynamo.bench.client import Endpoint, HttpClient
from dynamo.bench.connection import Connection
from dynamo.bench.request import RequestSpec, Sender

EVENTS: list[tuple[bytes | None, bytes]] = [
    (None, b'{"choices":[{"delta":{"role":"assistant","content":""}}]}'),
    (None, b'{"choices":[{"delta":{"content":"Hel"}}]}'),
    (b"request_id", b'"abc"'),
    (None, b"line one\nline two"),
    (b"error", b'{"message":"boom"}'),
    (None, b"[DONE]"),
]


def sse_body(crlf: bool) -> bytes:
    parts = [
        b"data: " + EVENTS[0][1] + b"\n\n",
        b"data: " + EVENTS[1][1] + b"\n\n",
        b'event: request_id\n: "abc"\n\n',
        b": keep-alive comment\n\n",
        b"data: line one\ndata: line two\n\n",
        b'event: error\ndata: {"message":"boom"}\n\n',
        b"data: [DONE]\n\n",
    ]
    body = b"".join(parts)
    return body.replace(b"\n", b"\r\n") if crlf else body


def chunked(body: bytes, sizes: list[int]) -> bytes:
    out = b""
    pos = 0
    for size in sizes:
        piece = body[pos : pos + size]
        pos += size
        if piece:
            out += b"%x;ext=1\r\n" % len(piece) + piece + b"\r\n"
    if pos < len(body):
        out += b"%x\r\n" % (len(body) - pos) + body[pos:] + b"\r\n"
    return out + b"0\r\nx-trailer: 1\r\n\r\n"


class FakeTransport:
    def __init__(self, protocol: Connection) -> None:
        self.protocol = protocol
        self.written = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written += data

    def get_extra_info(self, name: str) -> Any:
        return None

    def close(self) -> None:
        self.abort()

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)


class Sink:
    def __init__(self) -> None:
        self.events: list[tuple[bytes | None, bytes]] = []

    def on_event(self, event: bytes | None, data: bytes, now: float) -> None:
        self.events.append((event, data))


async def feed(raw: bytes, cuts: list[int], sink: Sink | None) -> tuple[Any, Connection]:
    conn = Connection()
    transport = FakeTransport(conn)
    conn.connection_made(transport)  # type: ignore[arg-type]
    pending = asyncio.ensure_future(conn.request(b"GET / HTTP/1.1\r\n\r\n", b"", sink))
    await asyncio.sleep(0)
    pos = 0
    for cut in [*cuts, len(raw)]:
        if cut > pos:
            conn.data_received(raw[pos:cut])
            pos = cut
    return await pending, conn


HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"


@pytest.mark.parametrize("crlf", [False, True])
async def test_sse_events_survive_every_split(crlf: bool) -> None:
    body = sse_body(crlf)
    raw = HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(body, [7, 50, 3, 90, 1, 40])
    rng = random.Random(5)
    splits = [[i] for i in range(1, len(raw))] + [
        sorted(rng.sample(range(1, len(raw)), 12)) for _ in range(50)
    ]
    for cuts in splits:
        sink = Sink()
        response, conn = await feed(raw, cuts, sink)
        assert response.status == 200 and response.streamed
        assert sink.events == EVENTS, cuts
        assert conn.reusable


async def test_content_length_and_close_delimited_bodies() -> None:
    raw = b'HTTP/1.1 404 Not Found\r\nContent-Length: 13\r\n\r\n{"error":"x"}'
    response, conn = await feed(raw, [20, 40], Sink())
    assert (response.status, response.body, response.streamed) == (404, b'{"error":"x"}', False)
    assert conn.reusable
    raw = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok"
    response, conn = await feed(raw, [], None)
    assert response.body == b"ok" and not conn.reusable
    conn2 = Connection()
    transport = FakeTransport(conn2)
    conn2.connection_made(transport)  # type: ignore[arg-type]
    pending = asyncio.ensure_future(conn2.request(b"GET / HTTP/1.1\r\n\r\n", b"", None))
    await asyncio.sleep(0)
    conn2.data_received(b"HTTP/1.0 200 OK\r\nContent-Type: text/html\r\n\r\n<html>")
    conn2.data_received(b"</html>")
    conn2.connection_lost(None)
    response = await pending
    assert response.body == b"<html></html>" and response.content_type == "text/html"


async def test_a_connection_lost_mid_response_fails_the_request() -> None:
    conn = Connection()
    conn.connection_made(FakeTransport(conn))  # type: ignore[arg-type]
    pending = asyncio.ensure_future(conn.request(b"GET / HTTP/1.1\r\n\r\n", b"", Sink()))
    await asyncio.sleep(0)
    conn.data_received(HEAD + b"Transfer-Encoding: chunked\r\n\r\n5\r\nda")
    conn.connection_lost(None)
    with pytest.raises(ConnectionError, match="mid-response"):
        await pending


def test_endpoint_parsing() -> None:
    endpoint = Endpoint.parse("http://127.0.0.1:8000/v1/")
    assert (endpoint.host, endpoint.port, endpoint.prefix) == ("127.0.0.1", 8000, "")
    assert Endpoint.parse("https://example.com/proxy").path("/v1/models") == "/proxy/v1/models"
    assert Endpoint.parse("https://example.com").port == 443
    for bad in ("ftp://x", "localhost:8000", "http://:80", "http://h:notaport"):
        with pytest.raises(ValueError):
            Endpoint.parse(bad)


class Server:
    """A loopback server that answers each request with a canned OpenAI SSE stream; it can
    close connections after one response or stay silent."""

    def __init__(
        self, close_after_response: bool = False, silent: bool = False, answers: int = 10**9
    ) -> None:
        self.close_after_response = close_after_response
        self.silent = silent
        self.answers = answers
        self.connections = 0
        self.requests: list[bytes] = []
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self._handlers: list[asyncio.Task[Any]] = []
        self.port = 0

    async def __aenter__(self) -> Server:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.close()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.append(writer)
        task = asyncio.current_task()
        assert task is not None
        self._handlers.append(task)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                self.requests.append(head + await reader.readexactly(length))
                if self.silent or len(self.requests) > self.answers:
                    continue
                events = [
                    b'{"choices":[{"delta":{"role":"assistant","content":""}}]}',
                    b'{"choices":[{"delta":{"content":"a"}}]}',
                    b'{"choices":[{"delta":{"content":"b"},"finish_reason":"length"}]}',
                    b'{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2,'
                    b'"prompt_tokens_details":{"cached_tokens":4}}}',
                    b"[DONE]",
                ]
                writer.write(HEAD + b"Transfer-Encoding: chunked\r\n\r\n")
                for event in events:
                    data = b"data: " + event + b"\n\n"
                    writer.write(b"%x\r\n" % len(data) + data + b"\r\n")
                    await writer.drain()
                    await asyncio.sleep(0.002)
                writer.write(b"0\r\n\r\n")
                await writer.drain()
                if self.close_after_response:
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            return


SPEC = RequestSpec(max_tokens=2, expected_prompt_tokens=5, prompt=[1, 2, 3, 4, 5])


async def test_sender_records_a_stream_over_one_keep_alive_connection() -> None:
    async with Server() as server:
        client = HttpClient(Endpoint.parse(f"http://127.0.0.1:{server.port}"))
        sender = Sender(client, api="completions", model="m", extra_body={"temperature": 0})
        records = [await sender.send(SPEC) for _ in range(3)]
        await client.aclose()
    assert server.connections == 1
    for record in records:
        assert record.ok, record.error_message
        assert (record.prompt_tokens, record.cached_tokens, record.output_tokens) == (5, 4, 2)
        assert record.ttft is not None and 0 < record.ttft <= record.e2e
        assert len(record.itl) == 1 and record.itl[0] > 0.001
        assert record.finish_reason == "length"
    body = server.requests[0].split(b"\r\n\r\n", 1)[1]
    assert b'"prompt":[1,2,3,4,5]' in body and b'"include_usage":true' in body
    assert b'"ignore_eos":true' in body and b'"nvext":{"ignore_eos":true}' in body
    assert b'"temperature":0' in body and server.requests[0].startswith(b"POST /v1/completions ")


async def test_a_connection_closed_by_the_server_is_replaced() -> None:
    async with Server(close_after_response=True) as server:
        client = HttpClient(Endpoint.parse(f"http://127.0.0.1:{server.port}"))
        sender = Sender(client, api="chat", model="m")
        spec = RequestSpec(max_tokens=2, expected_prompt_tokens=5, messages=[])
        records = [await sender.send(spec) for _ in range(3)]
        await client.aclose()
    assert all(record.ok for record in records)
    assert server.connections == 3
    assert server.requests[0].startswith(b"POST /v1/chat/completions ")


async def test_timeouts_and_refused_connections_become_error_records() -> None:
    async with Server(silent=True) as server:
        client = HttpClient(Endpoint.parse(f"http://127.0.0.1:{server.port}"))
        record = await Sender(client, api="completions", model="m", timeout=0.2).send(SPEC)
        await client.aclose()
    assert record.error == "timeout" and 0.2 <= record.e2e < 2.0
    client = HttpClient(Endpoint.parse(f"http://127.0.0.1:{server.port}"))
    record = await Sender(client, api="completions", model="m").send(SPEC)
    await client.aclose()
    assert record.error == "connect"


async def test_a_timeout_on_a_reused_connection_is_not_retried() -> None:
    async with Server(answers=1) as server:
        client = HttpClient(Endpoint.parse(f"http://127.0.0.1:{server.port}"))
        sender = Sender(client, api="completions", model="m", timeout=0.3)
        first, second = await sender.send(SPEC), await sender.send(SPEC)
        await client.aclose()
    assert first.ok and second.error == "timeout"
    assert 0.3 <= second.e2e < 0.55 and len(server.requests) == 2
