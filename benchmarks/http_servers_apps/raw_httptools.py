"""Reference point: a hand-rolled asyncio Protocol HTTP/1.1 server on httptools (uvloop).

`python -m benchmarks.http_servers_apps.raw_httptools PORT`. Minimal: keep-alive, chunked
responses, no pipelining guarantees. Not a candidate for production (the standard prefers
well-kept libraries); it bounds what the HTTP layer could cost.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import cast

import httptools
import uvloop

from benchmarks.http_servers_apps.common import parse_request, set_nodelay, sse_events

_NODELAY = os.environ.get("BENCH_NODELAY", "1") != "0"
_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)


class HttpProto(asyncio.Protocol):
    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.body: list[bytes] = []
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's TCPTransport is not an asyncio.Transport subclass, hence the cast.
        self.transport = cast(asyncio.Transport, transport)
        # BENCH_NODELAY=0 turns Nagle back on: the control case for the stall detector.
        set_nodelay(transport.get_extra_info("socket"), _NODELAY)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.close()

    def on_message_begin(self) -> None:
        self.body = []

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        t = self.transport
        if t is None:
            return
        req = parse_request(b"".join(self.body))
        t.write(_HEAD)
        for ev in sse_events(req):
            t.write(b"%x\r\n%s\r\n" % (len(ev), ev))
        t.write(b"0\r\n\r\n")


async def serve(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(HttpProto, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    uvloop.run(serve(int(sys.argv[1])))
