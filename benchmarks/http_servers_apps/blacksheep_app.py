"""BlackSheep candidate (served by granian ASGI)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from blacksheep import Application, Request, Response, StreamedContent

from benchmarks.http_servers_apps.common import parse_request, sse_events

app = Application()


@app.router.post("/v1/chat/completions")
async def chat(request: Request) -> Response:
    req = parse_request(await request.read() or b"")

    async def gen() -> AsyncIterator[bytes]:
        for ev in sse_events(req):
            yield ev

    return Response(
        200, [(b"cache-control", b"no-cache")], StreamedContent(b"text/event-stream", gen)
    )
