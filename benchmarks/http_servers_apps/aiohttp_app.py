"""aiohttp candidate: `python -m benchmarks.http_servers_apps.aiohttp_app PORT`."""

from __future__ import annotations

import sys

import uvloop
from aiohttp import web

from benchmarks.http_servers_apps.common import parse_request, sse_events


async def chat(request: web.Request) -> web.StreamResponse:
    req = parse_request(await request.read())
    resp = web.StreamResponse(
        headers={"content-type": "text/event-stream", "cache-control": "no-cache"}
    )
    await resp.prepare(request)
    for ev in sse_events(req):
        await resp.write(ev)
    await resp.write_eof()
    return resp


def main() -> None:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    web.run_app(
        app,
        host="127.0.0.1",
        port=int(sys.argv[1]),
        access_log=None,
        print=None,
        loop=uvloop.new_event_loop(),
    )


if __name__ == "__main__":
    main()
