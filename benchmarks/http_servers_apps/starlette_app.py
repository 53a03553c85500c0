"""Starlette candidate (served by granian ASGI or uvicorn)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from benchmarks.http_servers_apps.common import parse_request, sse_events


async def chat(request: Request) -> StreamingResponse:
    req = parse_request(await request.body())

    async def gen() -> AsyncIterator[bytes]:
        for ev in sse_events(req):
            yield ev

    return StreamingResponse(
        gen(), media_type="text/event-stream", headers={"cache-control": "no-cache"}
    )


app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
