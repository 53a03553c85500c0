"""The frontend's own HTTP front (``frontend/http_front.py`` on ``runtime/http_server.py``,
write-behind on) streaming the SSE workload, in one uvloop event loop.

`python -m benchmarks.http_servers_apps.dynamo_front PORT`.
"""

from __future__ import annotations

import asyncio
import signal
import sys

import uvloop

from benchmarks.http_servers_apps.common import SSE_HEADERS, parse_request, sse_events
from dynamo.frontend.exchange import Exchange
from dynamo.frontend.http_front import connection_factory
from dynamo.runtime.http_server import HttpServer


async def app(http: Exchange) -> None:
    if http.method != "POST":
        http.reply(405, [], b"")
        return
    req = parse_request(await http.body(1 << 20))
    sink = http.start_stream(200, SSE_HEADERS)
    for ev in sse_events(req):
        await sink.send(ev)


async def main(port: int) -> None:
    server = HttpServer(
        None, "127.0.0.1", port, write_behind=True, connection=connection_factory(app, 1 << 20)
    )
    await server.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop()


if __name__ == "__main__":
    uvloop.run(main(int(sys.argv[1])))
