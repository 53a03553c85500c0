"""One TCP connection of the request plane, either side: TCP_NODELAY, a reused receive buffer, a
coalescing write buffer (frames produced during one loop iteration leave in one
``transport.write``; a new request's frame, when it is the first of its iteration, leaves at
once) and write-side flow control (``pause_writing`` / ``resume_writing``)."""

from __future__ import annotations

import asyncio
import socket
from abc import ABC, abstractmethod
from typing import cast

from dynamo.runtime import codec
from dynamo.runtime.codec import FrameDecoder, data_frame_head
from dynamo.runtime.errors import InvalidArgument

_FLUSH_BYTES = 256 * 1024
"""Flush at once (instead of at the end of the loop iteration) beyond this many pending bytes."""
_READ_BUFFER = 256 * 1024


def set_nodelay(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class FrameWriter(asyncio.BufferedProtocol, ABC):
    """Connection base: reads into one reused buffer (a plain Protocol makes asyncio allocate,
    and for its 256 KiB reads mmap and unmap, a new buffer per ``recv``), hands ``data_received``
    a copy of what arrived; writes are coalesced and flow-controlled."""

    def __init__(self, loop: asyncio.AbstractEventLoop, max_frame_size: int) -> None:
        self.loop = loop
        self.max_frame_size = max_frame_size
        self.decoder = FrameDecoder(max_frame_size)
        self._max_data = max_frame_size - codec.data_overhead(max_frame_size)
        self.transport: asyncio.Transport | None = None
        self.paused = False
        self.broken = False
        self.closed: asyncio.Future[None] = loop.create_future()
        self.peer = "?"
        self._out: list[bytes] = []
        self._out_size = 0
        self._flush_pending = False
        self._drain: asyncio.Future[None] | None = None
        self._rbuf = memoryview(bytearray(_READ_BUFFER))

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._rbuf

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(bytes(self._rbuf[:nbytes]))

    @abstractmethod
    def data_received(self, data: bytes) -> None:
        """Handle bytes that arrived (server and client parse frames differently)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but implement its interface.
        self.transport = cast(asyncio.Transport, transport)
        set_nodelay(transport)
        self.peer = str(transport.get_extra_info("peername"))

    def write(self, data: bytes) -> None:
        self._out.append(data)
        self._out_size += len(data)
        if self._out_size >= _FLUSH_BYTES:
            self.flush()
        elif not self._flush_pending:
            self._flush_pending = True
            self.loop.call_soon(self.flush)

    def write_leading(self, head: bytes, body: bytes) -> None:
        """Queue one frame (``head`` + ``body``) and, when it is the first frame of this loop
        iteration, send it at once: a new request leaves while its sender goes on with its own
        work (at low concurrency that work is on the request's latency path), and whatever is
        queued later in the same iteration still leaves in one write, at its end."""
        leading = not self._flush_pending
        self.write(head)
        if body:
            self.write(body)
        if leading and self._flush_pending:  # (not pending: write() sent it all already)
            self.flush()
            self._flush_pending = True  # write() scheduled a flush: the rest coalesces into it

    def write_data(self, stream_id: int, body: bytes) -> None:
        """Queue one Annotated data frame (the hot path)."""
        n = len(body)
        if n > self._max_data:
            raise InvalidArgument(
                f"response body of {n} bytes exceeds the maximum frame size {self.max_frame_size}"
            )
        out = self._out
        out.append(data_frame_head(stream_id, n))
        out.append(body)
        self._out_size += n + 32
        if self._out_size >= _FLUSH_BYTES:
            self.flush()
        elif not self._flush_pending:
            self._flush_pending = True
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        self._flush_pending = False
        out = self._out
        if not out:
            return
        data = out[0] if len(out) == 1 else b"".join(out)
        out.clear()
        self._out_size = 0
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(data)

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self._release_drain()

    async def drained(self) -> None:
        """Wait until the transport accepts writes again (or the connection is gone)."""
        if self.paused and self.transport is not None:
            if self._drain is None:
                self._drain = self.loop.create_future()
            await asyncio.shield(self._drain)

    def _release_drain(self) -> None:
        drain, self._drain = self._drain, None
        if drain is not None and not drain.done():
            drain.set_result(None)

    def close(self) -> None:
        """Flush what is queued and close the connection."""
        self.flush()
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.paused = False
        self._out.clear()
        self._release_drain()
        if not self.closed.done():
            self.closed.set_result(None)
