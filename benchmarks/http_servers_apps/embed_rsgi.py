"""Granian RSGI embedded in our own asyncio process (the frontend's shape).

`python -m benchmarks.http_servers_apps.embed_rsgi PORT`: one event loop runs the granian
embedded server and our background tasks together.
"""

from __future__ import annotations

import asyncio
import signal
import sys

import uvloop
from granian.constants import Interfaces
from granian.server.embed import Server

from benchmarks.http_servers_apps.rsgi_app import app


async def ticker() -> None:
    # Stands in for discovery watches: proves they share the loop with the handlers.
    while True:
        await asyncio.sleep(1.0)


async def main(port: int) -> None:
    server = Server(
        app, address="127.0.0.1", port=port, interface=Interfaces.RSGI, log_access=False
    )
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, server.stop)
    bg = asyncio.create_task(ticker(), name="ticker")
    try:
        await server.serve()
    finally:
        bg.cancel()
        await asyncio.gather(bg, return_exceptions=True)


if __name__ == "__main__":
    uvloop.run(main(int(sys.argv[1])))
