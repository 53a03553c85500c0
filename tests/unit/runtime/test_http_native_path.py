"""The small HTTP server's native request path (``_http.c``) against httptools.

The native path must answer every byte stream exactly as the httptools path does: same app
calls, same bytes out, same connection ends. Streams mix plain requests (native) with ones it
leaves to httptools (chunked, Expect, HEAD, HTTP/1.0, odd headers, errors), split at random
points, so the hand-overs at request boundaries in both directions are exercised.
"""

from __future__ import annotations

import json
import random

import pytest

from dynamo.runtime.http_json import HttpProtocol, native_path
from dynamo.runtime.http_limits import HttpLimits
from tests.fakes import FakeTransport

LIMITS = HttpLimits(max_header_bytes=1024)
MAX_BODY = 4096


class EchoApp:
    """Answers each path differently, so every rendering branch is taken; records its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[bytes, bytes, bytes, bytes | None, bytes]] = []
        self.fast_routes = {b"/fast": self.fast}

    def fast(self, body: bytes) -> bytes | None:
        return None if body == b"none" else b'{"fast":%d}' % len(body)

    def handle(
        self, method: bytes, path: bytes, query: bytes, content_type: bytes | None, body: bytes
    ) -> tuple[int, bytes] | tuple[int, bytes, bytes]:
        if path == b"/fast":  # not recorded: the native path may have taken it as a fast route
            if body == b"none" or content_type != b"application/json" or method != b"POST":
                return 400, b'{"error":"not fast"}'
            return 200, b'{"fast":%d}' % len(body)
        if path == b"/empty":
            return 200, b""
        if path == b"/text":
            return 200, b"hi", b"text/plain"
        if path == b"/odd":
            return 299, b"{}"
        self.calls.append((method, path, query, content_type, body))
        if path == b"/raise":
            raise RuntimeError("handler bug")
        echo = [x.decode("latin-1") if x is not None else None for x in (method, path, query)]
        ct = None if content_type is None else content_type.decode("latin-1")
        return 201, json.dumps([*echo, ct, body.decode("latin-1")]).encode()


pytestmark = pytest.mark.skipif(
    native_path(EchoApp(), LIMITS, MAX_BODY) is None, reason="_http not built, or DYN_NATIVE=0"
)


def post(path: bytes, body: bytes, ctype: bytes = b"application/json", extra: bytes = b"") -> bytes:
    head = b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Type: %s\r\n" % (path, ctype)
    return head + extra + b"Content-Length: %d\r\n\r\n%s" % (len(body), body)


# Requests after which the connection stays open.
KEEP = [
    b"GET /a?x=1&y=%20z HTTP/1.1\r\nHost: t\r\n\r\n",
    b"GET /a HTTP/1.1\r\n\r\n",
    post(b"/a", b'{"k":1}'),
    post(b"/fast", b"[1,2,3]"),
    post(b"/fast", b"none"),
    post(b"/fast", b"[1]", b"application/json; charset=utf-8"),
    post(b"/fast?q=1", b"[1]"),
    post(b"/fast", b"[1]", b"text/plain"),
    b"POST /fast HTTP/1.1\r\nContent-Length: 3\r\n\r\n[1]",
    b"POST /a HTTP/1.1\r\nHost: t\r\n\r\n",
    b"GET /empty HTTP/1.1\r\n\r\n",
    b"GET /text HTTP/1.1\r\n\r\n",
    b"GET /odd HTTP/1.1\r\n\r\n",
    b"HEAD /a HTTP/1.1\r\n\r\n",
    b"HEAD /text HTTP/1.1\r\n\r\n",
    b"PUT /a HTTP/1.1\r\nContent-Length: 2\r\n\r\nhi",
    b"POST /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    b"POST /a HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\nok",
    b"GET /a HTTP/1.1\r\nConnection: keep-alive\r\n\r\n",
    b"GET /a HTTP/1.1\r\nCONNECTION: Keep-Alive\r\n\r\n",
    b"GET /a HTTP/1.1\r\nX-Tab: a\tb \t\r\nX-Empty:\r\n\r\n",
    b"GET /a HTTP/1.1\r\nX-Obs: caf\xc3\xa9\r\n\r\n",
    post(b"/a", b"x" * 10, extra=b"CONTENT-TYPE: text/other\r\n"),
    b"POST /a HTTP/1.1\r\ncontent-length: 3\r\ncontent-type: a/b\r\n\r\nabc",
    b"POST /a HTTP/1.1\r\nContent-Length: 007\r\n\r\nabcdefg",
    b"GET /%7e/b;c=d/e:f@g!$'()*+,= HTTP/1.1\r\n\r\n",
    b"GET http://t/abs?x HTTP/1.1\r\n\r\n",
    b"GET /frag#x HTTP/1.1\r\n\r\n",
    post(b"/a", b"y" * MAX_BODY),
    b"\r\nGET /after-crlf HTTP/1.1\r\n\r\n",
]
# Requests that end the connection (so they end a stream).
LAST = [
    b"GET /a HTTP/1.1\r\nConnection: close\r\n\r\n",
    b"GET /a HTTP/1.0\r\n\r\n",
    b"GET /a HTTP/1.1\r\nBad Header\r\n\r\n",
    b"GET /a HTTP/1.1\r\nX: \x01\r\n\r\n",
    b"POST /a HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
    b"POST /a HTTP/1.1\r\nContent-Length: 1x\r\n\r\nab",
    b"POST /a HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % (MAX_BODY + 1),
    b"GET /a HTTP/1.1\r\nX-Big: " + b"b" * 1100 + b"\r\n\r\n",
    b"GET /" + b"u" * 1100 + b" HTTP/1.1\r\n\r\n",
    b"GET /a HTTP/1.1\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n",
    b"GET /a HTTP/2.0\r\n\r\n",
    b"BREW /a HTTP/1.1\r\n\r\n",
    b"GET /raise HTTP/1.1\r\n\r\n",
    post(b"/raise", b"{}"),
    b"GET /a HTTP/1.1\r\nHost: t\r\n",  # incomplete: nothing is answered
    post(b"/a", b"12345")[:-2],  # incomplete body
]


def run(stream: bytes, cuts: list[int], native: bool) -> tuple[bytes, bool, list[object]]:
    app = EchoApp()
    dispatcher = native_path(app, LIMITS, MAX_BODY) if native else None
    assert (dispatcher is not None) == native
    proto = HttpProtocol(app, MAX_BODY, set(), None, None, LIMITS, dispatcher)
    transport = FakeTransport()
    proto.connection_made(transport)  # type: ignore[arg-type]
    last = 0
    for cut in [*cuts, len(stream)]:
        if cut > last:
            proto.data_received(stream[last:cut])
            last = cut
    return bytes(transport.out), transport.closed, list(app.calls)


def test_native_path_answers_every_stream_as_httptools_does() -> None:
    rng = random.Random(12)
    cases = [([req], []) for req in KEEP + LAST]
    for _ in range(400):
        reqs = rng.choices(KEEP, k=rng.randint(1, 6))
        if rng.random() < 0.5:
            reqs.append(rng.choice(LAST))
        stream = b"".join(reqs)
        cuts = sorted(rng.sample(range(1, len(stream)), k=min(len(stream) - 1, rng.randint(0, 3))))
        cases.append((reqs, cuts))
    for reqs, cuts in cases:
        stream = b"".join(reqs)
        assert run(stream, cuts, True) == run(stream, cuts, False), (reqs, cuts)


def test_plain_requests_are_answered_in_one_native_call() -> None:
    app = EchoApp()
    dispatcher = native_path(app, LIMITS, MAX_BODY)
    assert dispatcher is not None
    two = post(b"/fast", b"[1,2]") + b"GET /a?q HTTP/1.1\r\nHost: t\r\n\r\n"
    out, used, error = dispatcher.feed(two + b"HEAD /a HTTP/1.1\r\n\r\n")
    assert error is None
    assert used == len(two) and out is not None
    assert out.startswith(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n")
    assert out.count(b"HTTP/1.1 ") == 2 and b'{"fast":5}' in out
    assert app.calls == [(b"GET", b"/a", b"q", None, b"")]
    assert dispatcher.feed(b"GET /a HTTP/1.1\r\n") == (None, 0, None)  # incomplete: not taken


def test_fast_route_that_breaks_its_contract_is_an_error() -> None:
    app = EchoApp()
    app.fast_routes = {b"/fast": lambda body: b""}
    dispatcher = native_path(app, LIMITS, MAX_BODY)
    assert dispatcher is not None
    first = b"GET /a HTTP/1.1\r\n\r\n"
    out, used, error = dispatcher.feed(first + post(b"/fast", b"[]"))
    assert out is not None and out.startswith(b"HTTP/1.1 201 ") and used == len(first)
    assert isinstance(error, TypeError) and "fast route" in str(error)
