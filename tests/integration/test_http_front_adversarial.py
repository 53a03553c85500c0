"""The frontend's HTTP/1.1 front (``http_front.py``) against hostile clients on raw sockets, in
one process: request smuggling shapes, odd request lines and versions, Expect/HEAD/OPTIONS,
pipelining (with errors in the middle), clients that never read, half-close, reset or vanish
together, and slowloris on heads and bodies. Every error is an OpenAI body with the right status
and ``content-length``, a framing error closes the connection, a client mistake logs no ERROR,
and whatever a request held (in-flight place, router load, KV blocks) is freed."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
from dataclasses import dataclass

import pytest

import dynamo.frontend.app as frontend_app
from dynamo.frontend.http_front import FEED_BYTES, MAX_QUEUED
from dynamo.runtime.http_limits import HttpLimits
from tests.integration.conftest import Stack

pytestmark = pytest.mark.integration

LIMITS = HttpLimits(body_timeout_s=1.0, header_timeout_s=1.5)
CHAT = b"/v1/chat/completions"


def chat_request(stream: bool, max_tokens: int = 4, extra: bytes = b"", **fields: object) -> bytes:
    body = json.dumps(
        {
            "model": "demo",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": stream,
            **fields,
        }
    ).encode()
    return (
        b"POST %s HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n%s"
        b"content-length: %d\r\n\r\n%s" % (CHAT, extra, len(body), body)
    )


def get(path: bytes, method: bytes = b"GET", close: bool = False) -> bytes:
    tail = b"connection: close\r\n" if close else b""
    return b"%s %s HTTP/1.1\r\nhost: t\r\n%s\r\n" % (method, path, tail)


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes


def parse(data: bytes, head_only: tuple[int, ...] = ()) -> list[Response]:
    """Split a connection's output into its responses (content-length or chunked bodies;
    those whose index is in ``head_only`` answered a HEAD). Interim 100s are kept."""
    out: list[Response] = []
    while data:
        head, sep, data = data.partition(b"\r\n\r\n")
        assert sep, f"truncated head: {head[:200]!r}"
        line, *fields = head.decode("latin-1").split("\r\n")
        assert line.startswith("HTTP/1.1 "), line
        status = int(line.split()[1])
        headers: dict[str, str] = {}
        for field in fields:
            name, _, value = field.partition(":")
            assert name.lower() not in headers, f"duplicate header {name}"
            headers[name.lower()] = value.strip()
        body = b""
        if status == 100:
            pass
        elif headers.get("transfer-encoding") == "chunked":
            assert "content-length" not in headers
            while True:
                size_line, _, data = data.partition(b"\r\n")
                size = int(size_line, 16)
                body += data[:size]
                assert data[size : size + 2] == b"\r\n", data[size : size + 20]
                data = data[size + 2 :]
                if size == 0:
                    break
        else:
            length = int(headers["content-length"])
            if len(out) - sum(r.status == 100 for r in out) not in head_only:
                body, data = data[:length], data[length:]
                assert len(body) == length, (length, body[:200])
        out.append(Response(status, headers, body))
    return out


def assert_openai_error(resp: Response, status: int) -> None:
    assert resp.status == status, (resp.status, resp.body[:300])
    assert resp.headers["content-type"] == "application/json"
    error = json.loads(resp.body)["error"]
    assert error["code"] == status and isinstance(error["message"], str), error
    assert error["type"] != "internal_error" and "Traceback" not in error["message"], error


async def talk(port: int, data: bytes, timeout: float = 10.0, rcvbuf: int = 0) -> bytes:
    """Send ``data`` in one write; read until the server closes (a reset ends it too)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    out = bytearray()
    try:
        async with asyncio.timeout(timeout):
            while chunk := await reader.read(65536):
                out += chunk
    except ConnectionResetError:
        pass
    finally:
        writer.close()
    return bytes(out)


def assert_no_error_logs(caplog: pytest.LogCaptureFixture) -> None:
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not bad, [r.getMessage() for r in bad]


async def start(stack: Stack, *flags: str, speedup: int = 50, **config: object) -> int:
    await stack.add_worker("--speedup-ratio", str(speedup), *flags)
    await stack.start_frontend(limits=LIMITS, **config)
    await stack.wait_for_model()
    assert stack.frontend is not None
    return stack.frontend.port


async def wait_all_freed(stack: Stack) -> None:
    """In-flight places, the routers' loads and the workers' KV blocks back to zero."""
    assert stack.frontend is not None
    frontend = stack.frontend
    async with asyncio.timeout(10):
        while True:
            held = [
                r.kv_used_blocks
                for w in stack.workers
                for e in w.engines
                for r in e.metrics_snapshot()
            ]
            routers = frontend.registry.live_routers()
            loads = sum(len(getattr(r, "sequences", ())) for r in routers)  # the KV router's
            if frontend.generate.inflight == 0 and loads == 0 and not any(held):
                return
            await asyncio.sleep(0.05)


# Framing errors: (request bytes, status). Each is answered once, then the connection closes;
# what follows the bad request (a smuggled second one) is never answered.
SMUGGLED = get(b"/v1/models")
FRAMING = {
    "content-length and transfer-encoding": (
        b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-length: 5\r\n"
        b"transfer-encoding: chunked\r\n\r\n0\r\n\r\n" + SMUGGLED,
        400,
    ),
    "two content-lengths": (
        b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-length: 4\r\n"
        b"content-length: 40\r\n\r\nabcd" + SMUGGLED,
        400,
    ),
    "negative content-length": (
        b"POST /v1/completions HTTP/1.1\r\ncontent-length: -1\r\n\r\n",
        400,
    ),
    "signed content-length": (
        b"POST /v1/completions HTTP/1.1\r\ncontent-length: +2\r\n\r\n{}",
        400,
    ),
    "text content-length": (b"POST /v1/completions HTTP/1.1\r\ncontent-length: ten\r\n\r\n", 400),
    "overflowing content-length": (
        b"POST /v1/completions HTTP/1.1\r\ncontent-length: 99999999999999999999999\r\n\r\n",
        400,
    ),
    "huge content-length": (
        b"POST /v1/completions HTTP/1.1\r\ncontent-length: 99999999999\r\n\r\n{" + SMUGGLED,
        413,
    ),
    "gzip, chunked": (
        b"POST /v1/completions HTTP/1.1\r\ntransfer-encoding: gzip, chunked\r\n\r\n"
        b"2\r\n{}\r\n0\r\n\r\n" + SMUGGLED,
        501,
    ),
    "chunked, gzip": (
        b"POST /v1/completions HTTP/1.1\r\ntransfer-encoding: chunked, gzip\r\n\r\n{}" + SMUGGLED,
        400,
    ),
    "bad chunk size": (
        b"POST /v1/completions HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
        400,
    ),
    "overflowing chunk size": (
        b"POST /v1/completions HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n"
        b"fffffffffffffffffff\r\n{}",
        400,
    ),
    "obs-fold": (b"GET /v1/models HTTP/1.1\r\nhost: t\r\nx-a: b\r\n c\r\n\r\n" + SMUGGLED, 400),
    "bare LF": (b"GET /v1/models HTTP/1.1\nhost: t\n\n" + SMUGGLED, 400),
    "space before colon": (b"GET /v1/models HTTP/1.1\r\nhost : t\r\n\r\n", 400),
    "NUL in a header": (b"GET /v1/models HTTP/1.1\r\nx-a: a\x00b\r\n\r\n", 400),
    "absurd method": (b"X" * 300 + b" /v1/models HTTP/1.1\r\n\r\n", 400),
    "HTTP/9.9": (b"GET /v1/models HTTP/9.9\r\n\r\n", 400),
    "HTTP/2 preface": (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 400),
    "TLS ClientHello": (bytes.fromhex("16030100c4010000c00303") + bytes(range(32)) * 6, 400),
    "100 kB URL": (b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\n\r\n", 431),
}
FRAMING["101 header fields"] = (b"GET /v1/models HTTP/1.1\r\n" + b"a: b\r\n" * 101 + b"\r\n", 431)
FRAMING["100 kB of headers"] = (
    b"GET /v1/models HTTP/1.1\r\n"
    + b"".join(b"x-%d: %s\r\n" % (i, b"p" * 990) for i in range(100)),
    431,
)


async def test_framing_errors_are_answered_once_then_closed(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    port = await start(stack)
    answers = await asyncio.gather(*(talk(port, data) for data, _ in FRAMING.values()))
    for (name, (_, status)), answer in zip(FRAMING.items(), answers, strict=True):
        responses = parse(answer)
        assert len(responses) == 1, (name, answer[:500])  # the smuggled request: unanswered
        assert_openai_error(responses[0], status)
        assert responses[0].headers["connection"] == "close", name
    # a bad chunk size while the handler waits for the body: one 400, the handler let go
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(chat_request(False).partition(b"content-length")[0])
    writer.write(b"transfer-encoding: chunked\r\n\r\n1\r\n{\r\n")
    await asyncio.sleep(0.2)
    writer.write(b"zz\r\n")
    async with asyncio.timeout(10):
        [bad] = parse(await reader.read())
    writer.close()
    assert_openai_error(bad, 400)
    assert stack.frontend is not None and stack.frontend.generate.inflight == 0
    assert_no_error_logs(caplog)
    assert (parse(await talk(port, get(b"/v1/models", close=True))))[0].status == 200


async def test_targets_versions_and_methods(stack: Stack, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    port = await start(stack)
    models = parse(await talk(port, get(b"/v1/models", close=True)))[0]
    assert models.status == 200
    # absolute-form (what a proxy sends) routes by its path
    [absolute] = parse(await talk(port, get(b"http://t:1/v1/models?x=1", close=True)))
    assert absolute.status == 200 and absolute.body == models.body
    # 100 header fields (hyper's limit) are fine; 101 are a 431 (above)
    fields = b"".join(b"x-%d: v\r\n" % i for i in range(99))
    [many] = parse(
        await talk(port, b"GET /live HTTP/1.1\r\n" + fields + b"connection: close\r\n\r\n")
    )
    assert many.status == 200
    # an Upgrade is ignored (the request answered as HTTP/1.1), and what follows it unread
    upgrade = b"GET /v1/models HTTP/1.1\r\nconnection: upgrade\r\nupgrade: h2c\r\n\r\n"
    [answer] = parse(await talk(port, upgrade + b"\x00\x00\x12\x04" + get(b"/live")))
    assert answer.status == 200 and answer.body == models.body
    assert answer.headers["connection"] == "close"
    # "OPTIONS *", OPTIONS, PUT, HEAD on a POST route: answered, the connection kept
    answer = await talk(
        port,
        get(b"*", b"OPTIONS")
        + get(b"/v1/models", b"OPTIONS")
        + get(CHAT, b"PUT")
        + get(CHAT, b"HEAD")
        + get(b"/v1/completions", b"DELETE", close=True),
    )
    star, options, put, head, delete = parse(answer, head_only=(3,))
    assert_openai_error(star, 404)
    assert_openai_error(options, 405)
    assert options.headers["allow"] == "GET, HEAD"
    for resp in (put, delete):
        assert_openai_error(resp, 405)
        assert resp.headers["allow"] == "POST"
    assert head.status == 405 and head.body == b"" and int(head.headers["content-length"]) > 0
    # HEAD on every GET route: the GET's head without its body, then the next answer at once
    for path in (
        b"/v1/models",
        b"/v1/models/demo",
        b"/live",
        b"/health",
        b"/metrics",
        b"/dynamo/alpha/list-models",
    ):
        first, second = parse(
            await talk(port, get(path, b"HEAD") + get(b"/live", close=True)), head_only=(0,)
        )
        assert first.status == 200 and first.body == b"", path
        assert int(first.headers["content-length"]) > 0, path
        assert second.status == 200 and json.loads(second.body)["status"] == "live"
    [first] = parse(
        await talk(port, get(b"/v1/models", b"HEAD")[:-2] + b"connection: close\r\n\r\n"), (0,)
    )
    assert first.headers["content-length"] == str(len(models.body))
    # HTTP/1.0: closed after the answer; with keep-alive, kept (and told so)
    [old] = parse(await talk(port, b"GET /v1/models HTTP/1.0\r\n\r\n"))
    assert old.status == 200 and old.headers["connection"] == "close"
    keep = b"GET /v1/models HTTP/1.0\r\nconnection: keep-alive\r\n\r\n"
    first, second = parse(await talk(port, keep + b"GET /live HTTP/1.0\r\n\r\n"))
    assert first.headers["connection"] == "keep-alive" and first.body == models.body
    assert second.status == 200 and second.headers["connection"] == "close"
    # HTTP/1.0 with a transfer coding: answered, then closed (RFC 9112 6.1), what follows unread
    chunked10 = b"POST /v1/completions HTTP/1.0\r\nconnection: keep-alive\r\n"
    chunked10 += b"transfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
    [faulty] = parse(await talk(port, chunked10 + b"GET /live HTTP/1.0\r\n\r\n"))
    assert_openai_error(faulty, 400)
    assert faulty.headers["connection"] == "close"
    # a body on a GET is read and dropped; the next request is served
    with_body = b"GET /v1/models HTTP/1.1\r\ncontent-length: 5\r\n\r\nhello"
    first, second = parse(await talk(port, with_body + get(b"/live", close=True)))
    assert first.status == 200 and second.status == 200
    # Expect: 100-continue: the 100, then the answer; too large a body: no 100, a 413
    expect = chat_request(False, extra=b"expect: 100-continue\r\n")
    interim, answer_ = parse(
        await talk(port, expect.replace(b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n", 1))
    )
    assert interim.status == 100 and answer_.status == 200
    big = b"POST /v1/completions HTTP/1.1\r\nexpect: 100-continue\r\ncontent-length: 999999999"
    big += b"\r\n\r\n"
    [refused] = parse(await talk(port, big))
    assert_openai_error(refused, 413)
    assert refused.headers["connection"] == "close"
    assert_no_error_logs(caplog)


async def test_pipelining_in_order_and_errors_after_the_answers_before_them(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    port = await start(stack, "--block-size", "16", router_mode="kv")
    # 50 requests in one write: streamed and unary chats, model listings, in order
    kinds = ["models" if i % 3 == 0 else "stream" if i % 3 == 1 else "unary" for i in range(50)]
    data = b"".join(
        get(b"/v1/models") if k == "models" else chat_request(k == "stream", max_tokens=3)
        for k in kinds
    )
    responses = parse(await talk(port, data + get(b"/live", close=True)))
    assert [r.status for r in responses] == [200] * 51
    for kind, resp in zip(kinds, responses, strict=False):
        if kind == "stream":
            assert resp.headers["content-type"] == "text/event-stream"
            assert resp.body.endswith(b"data: [DONE]\n\n")
        elif kind == "unary":
            assert json.loads(resp.body)["object"] == "chat.completion"
        else:
            assert json.loads(resp.body)["object"] == "list"
    # 5000 tiny requests in one write: answered in order, while the requests parsed ahead of
    # their turn stay few (a read is parsed slice by slice, the rest held while the queue is
    # full; before, a 256 KiB read became 5000 queued exchanges)
    assert stack.frontend is not None and stack.frontend._server is not None
    connections = stack.frontend._server._connections
    many = asyncio.create_task(talk(port, get(b"/live") * 5000 + get(b"/live", close=True)))
    most_queued = 0
    while not many.done():
        most_queued = max([most_queued, *(len(c._queue) for c in connections)])
        await asyncio.sleep(0)
    assert (await many).count(b"HTTP/1.1 200 OK\r\n") == 5001
    assert most_queued <= MAX_QUEUED + FEED_BYTES // len(get(b"/live")), most_queued
    # a malformed request, an over-long head, an Expect behind a running stream: the stream is
    # answered whole first (nothing written inside it), then the error and the close
    expect_head = chat_request(False, extra=b"expect: 100-continue\r\n").partition(b"\r\n\r\n")[0]
    for tail, statuses in (
        (b"GARBAGE\r\n\r\n" + get(b"/live"), [200, 400]),
        (b"GET /" + b"a" * 70_000, [200, 431]),
        (expect_head + b"\r\n\r\n{", [200, 100, 408]),
    ):
        answer = await talk(port, chat_request(True, max_tokens=12) + tail)
        first, *rest = parse(answer)
        assert first.body.endswith(b"data: [DONE]\n\n") and first.body.count(b"data: {") >= 1
        assert [first.status] + [r.status for r in rest] == statuses
        assert_openai_error(rest[-1], statuses[-1])
    # after a 413 (body left unsent) and a 408 (body never complete), the pipelined request
    # behind is not read as a request: one answer, then the close
    too_big = b"POST /v1/completions HTTP/1.1\r\ncontent-length: 99999999\r\n\r\n"
    [refused] = parse(await talk(port, too_big + b"x" * 5000 + get(b"/live")))
    assert_openai_error(refused, 413)
    short = chat_request(False).replace(b"content-length: ", b"content-length: 1")
    [late] = parse(await talk(port, short + get(b"/live")))
    assert_openai_error(late, 408)
    # 50 streams pipelined, the client resets after the first bytes: everything is freed
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"".join(chat_request(True, max_tokens=200) for _ in range(50)))
    assert (await reader.read(100)).startswith(b"HTTP/1.1 200")
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.close()
    await wait_all_freed(stack)
    assert_no_error_logs(caplog)


async def test_vanishing_clients_free_everything(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    # slow enough that 2,000 tokens (over 11 s at 1x) outlast the test's reading of 40 heads on
    # a loaded machine (at 50x a CI run saw every stream finish before the check that they are
    # in flight); every stream here is cut short, so the pace costs the test nothing
    port = await start(stack, "--block-size", "16", speedup=1, router_mode="kv")
    assert stack.frontend is not None
    # half-closed after the request (a disconnect, as for hyper): nothing runs on for it
    for stream in (True, False):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(chat_request(stream, max_tokens=2000))
        writer.write_eof()
        async with asyncio.timeout(10):
            await reader.read()
        writer.close()
    await wait_all_freed(stack)
    # 40 streams reset at the same moment (SO_LINGER 0), mid-stream
    conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(40)]
    for _, writer in conns:
        writer.write(chat_request(True, max_tokens=2000))
    for reader, _ in conns:
        assert (await reader.read(100)).startswith(b"HTTP/1.1 200")
    assert stack.frontend.generate.inflight > 0
    for _, writer in conns:
        writer.get_extra_info("socket").setsockopt(
            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
        )
        writer.close()
    await wait_all_freed(stack)
    # and 40 more that just close (FIN) mid-stream, together
    conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(40)]
    for _, writer in conns:
        writer.write(chat_request(True, max_tokens=2000))
    for reader, _ in conns:
        await reader.read(100)
    for _, writer in conns:
        writer.close()
    await wait_all_freed(stack)
    [live] = parse(await talk(port, get(b"/live", close=True)))
    assert live.status == 200
    assert_no_error_logs(caplog)


async def test_a_client_that_never_reads_is_dropped_and_its_request_cancelled(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write-behind thread's backlog bound (small here) ends a stream nobody reads: the
    request is cancelled and frees its router load and KV blocks; others are served."""
    monkeypatch.setattr(frontend_app, "MAX_UNREAD_BYTES", 16 * 1024)
    await stack.add_worker("--speedup-ratio", "5", "--block-size", "16")
    await stack.start_frontend(limits=LIMITS, router_mode="kv")
    await stack.wait_for_model()
    assert stack.frontend is not None
    server = stack.frontend._server
    assert server is not None and server._server is not None
    for listener in server._server.sockets:  # accepted sockets inherit small kernel buffers
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", stack.frontend.port))
    try:
        big = chat_request(True, max_tokens=1000, logprobs=True, top_logprobs=20)
        await asyncio.get_running_loop().sock_sendall(sock, big)
        async with asyncio.timeout(10):
            while stack.frontend.generate.inflight == 0:
                await asyncio.sleep(0.01)
        [live] = parse(await talk(stack.frontend.port, get(b"/live", close=True)))
        assert live.status == 200
        async with asyncio.timeout(20):
            while server.dropped_connections == 0:
                await asyncio.sleep(0.05)
        await wait_all_freed(stack)
    finally:
        sock.close()


async def test_slowloris_heads_and_bodies_do_not_stop_others(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    """60 connections trickle a head or a body a byte at a time; a normal client is served
    meanwhile, and each slow one is answered 408 and closed."""
    caplog.set_level(logging.WARNING)
    port = await start(stack)
    head = chat_request(False)
    body_at = head.index(b"\r\n\r\n") + 4

    async def trickle(data: bytes, start: int) -> bytes:
        """Send ``data[:start]``, then a byte every 0.1 s until the server answers."""
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        answer = asyncio.create_task(reader.read())  # up to the server's close
        writer.write(data[:start])
        try:
            for i in range(start, len(data) - 1):
                await asyncio.wait([answer], timeout=0.1)
                if answer.done():
                    break
                writer.write(data[i : i + 1])
            async with asyncio.timeout(10):
                return await answer
        finally:
            writer.close()

    slow = [asyncio.create_task(trickle(head, 1 if i % 2 else body_at)) for i in range(60)]
    for _ in range(5):
        [resp] = parse(
            await talk(port, chat_request(False).replace(b"host: t", b"connection: close"))
        )
        assert resp.status == 200
        await asyncio.sleep(0.2)
    for answer in await asyncio.gather(*slow):
        [resp] = parse(answer)
        assert_openai_error(resp, 408)
        assert resp.headers["connection"] == "close"
    assert_no_error_logs(caplog)
