"""Granian RSGI candidate: a bare RSGI callable streaming the SSE workload."""

from __future__ import annotations

from typing import Any

from benchmarks.http_servers_apps.common import SSE_HEADERS, parse_request, sse_events


async def app(scope: Any, proto: Any) -> None:
    if scope.method != "POST":
        proto.response_empty(405, [])
        return
    req = parse_request(await proto())
    transport = proto.response_stream(200, SSE_HEADERS)
    for ev in sse_events(req):
        await transport.send_bytes(ev)
