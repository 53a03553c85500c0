"""Minimal granian RSGI SSE server embedded in our own asyncio loop, with disconnect detection.

The integration recipe for the frontend, verified against granian 2.8.7:
`python -m benchmarks.http_servers_apps.rsgi_sse_example` serves on an ephemeral port, runs a
background task in the same loop, and stops a request's work when its client disconnects.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from collections.abc import AsyncGenerator
from typing import Any

import uvloop
from granian._granian import ListenerSpec
from granian._granian import RSGIProtocolClosed as ProtocolClosed
from granian.constants import Interfaces
from granian.server.embed import Server


class EmbeddedServer(Server):
    """granian's embedded server, bound once up front so port 0 works and the port is known.

    On Linux granian normally passes a listener *spec* to each worker, which binds it itself;
    with port 0 nobody could learn the port. Binding the shared holder here (granian's
    non-Linux path) fixes that; with one worker nothing else changes. Overrides a private hook.
    """

    bound_port: int = 0

    def _init_shared_socket(self) -> None:
        holder = ListenerSpec(self.bind_addr, self.bind_port, self.backlog).build()
        fd = holder.get_fd()
        # granian declares these attributes as None-typed; they hold the shared listener.
        self._shd = holder  # type: ignore[assignment]
        self._sfd = fd  # type: ignore[assignment]
        self._ssp = None
        with socket.socket(fileno=os.dup(fd)) as s:
            self.bound_port = s.getsockname()[1]


async def token_source(stop: asyncio.Event) -> AsyncGenerator[bytes, None]:
    """Stands in for the engine stream; honours `stop` the way a Context would."""
    for i in range(1000):
        if stop.is_set():
            print(f"engine: aborted after {i} tokens")  # the frontend would ctx.stop() here
            return
        await asyncio.sleep(0.01)
        yield b'data: {"i": %d}\n\n' % i


async def app(scope: Any, proto: Any) -> None:
    if scope.proto != "http" or scope.method != "POST":
        proto.response_empty(405, [])
        return
    await proto()  # the request body
    stop = asyncio.Event()  # the frontend: its request Context; stop() aborts the engine

    def on_disconnect(f: asyncio.Future[None]) -> None:
        if not f.cancelled():
            print("client disconnected: stopping the request", flush=True)
            stop.set()

    # Resolves when the peer closes (also before the response starts), even while the handler
    # awaits something else; it stays pending after a normal completion on a keep-alive
    # connection, so it must be cancelled in `finally`.
    watch = asyncio.ensure_future(proto.client_disconnect())
    watch.add_done_callback(on_disconnect)
    transport = proto.response_stream(200, [("content-type", "text/event-stream")])
    tokens = token_source(stop)
    try:
        async for event in tokens:
            await transport.send_bytes(event)  # raises ProtocolClosed once the peer is gone
        await transport.send_bytes(b"data: [DONE]\n\n")
    except ProtocolClosed:
        stop.set()
    finally:
        watch.cancel()
        await tokens.aclose()


async def main() -> None:
    server = EmbeddedServer(app, address="127.0.0.1", port=0, interface=Interfaces.RSGI)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, server.stop)
    loop.add_signal_handler(signal.SIGTERM, server.stop)

    async def background() -> None:  # e.g. discovery watches: same loop as the handlers
        while True:
            await asyncio.sleep(5)

    bg = asyncio.create_task(background(), name="discovery-watch")
    serving = asyncio.create_task(server.serve(), name="http-server")
    while not server.bound_port and not serving.done():
        await asyncio.sleep(0.01)
    print(f"listening on http://127.0.0.1:{server.bound_port}", flush=True)
    try:
        await serving
    finally:
        bg.cancel()
        await asyncio.gather(bg, return_exceptions=True)


if __name__ == "__main__":
    uvloop.run(main())
