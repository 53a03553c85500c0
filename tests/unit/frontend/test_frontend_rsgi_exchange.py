"""The RSGI adapter drops its references to granian's transport when the handler returns:
granian ends a streamed response only when the transport is freed, so a reference cycle (an
exception's traceback after streaming began) must not keep the client's response open."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest

from dynamo.frontend.app import _RSGIExchange

pytestmark = pytest.mark.unit


class FakeTransport:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    async def send_bytes(self, data: bytes) -> None:
        self.sent.append(data)


class FakeProtocol:
    def __init__(self) -> None:
        self.transport: FakeTransport | None = FakeTransport()

    def response_stream(self, status: int, headers: list[tuple[str, str]]) -> FakeTransport:
        transport, self.transport = self.transport, None  # granian hands it over
        assert transport is not None
        return transport


class FakeScope:
    method = "POST"
    path = "/v1/chat/completions"
    headers: dict[str, str] = {}


async def test_release_frees_the_stream_transport_despite_a_cycle() -> None:
    gc.disable()  # the point: freed at once, without waiting for a GC run
    try:
        exchange = _RSGIExchange(FakeScope(), FakeProtocol())
        sink = exchange.start_stream(200, [])
        await sink.send(b"data: x\n\n")
        transport = sink._transport  # type: ignore[attr-defined]
        ref = weakref.ref(transport)
        assert transport.sent == [b"data: x\n\n"]
        del transport
        try:  # a cycle through a traceback that holds the sink, like an error mid-stream
            raise RuntimeError("boom")
        except RuntimeError as exc:
            keep: list[Any] = [exc, sink]
            keep.append(keep)
        assert ref() is not None
        exchange.release()
        assert ref() is None
        with pytest.raises(ConnectionError):
            await sink.send(b"late")
    finally:
        gc.enable()
