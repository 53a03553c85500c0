"""Refuses, with a 503, the connections the frontend has no place for.

granian serves at most ``--http-max-connections`` connections (its ``backpressure``): past that
it stops calling ``accept``, and new connections wait in the kernel's listen backlog, where a
client sees nothing at all (a hang, or a SYN dropped once the backlog is full). granian has no
option to answer them, so this does it from the outside: it watches a dup of the listening
socket; when a connection has waited there ``grace_s`` without granian taking it, it counts the
connections this process holds on the port (``/proc/self/fd``, in a thread), and only if they
reach the limit (granian is full, not merely late: a stalled thread or a loaded machine delays
an accept too) does it accept what is waiting itself and answer each ``503`` with an OpenAI error
body, ``Retry-After`` and ``Connection: close``, then close it. Otherwise it looks again after
another grace period.

The wake-up is event-driven (the listening socket turns readable), not a poll: one callback per
burst of new connections, then a single timer; nothing runs while connections are taken at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
import sys

from dynamo.frontend.errors import HTTPError, to_http
from dynamo.frontend.idle_reaper import count_connections

log = logging.getLogger(__name__)

_TCP_INFO = getattr(socket, "TCP_INFO", 11)
# struct tcp_info: 8 one-byte fields, then u32 rto, ato, snd_mss, rcv_mss, unacked. For a
# listening socket Linux reports its accept-queue length in ``tcpi_unacked``.
_UNACKED = struct.Struct("=I")
_UNACKED_OFFSET = 8 + 4 * 4
_INFO_LEN = _UNACKED_OFFSET + _UNACKED.size
_LINGER_S = 1.0
"""A refused socket is closed this long after its answer, so that the client reads the answer
rather than a reset caused by request bytes still arriving."""
_MAX_LINGERING = 1024
"""Refused sockets kept open for ``_LINGER_S`` at most at once; beyond, closed at once."""


def refusal_response() -> bytes:
    """The complete HTTP/1.1 answer to a connection past the limit."""
    reply = to_http(HTTPError(503, "too many connections: the server is at its connection limit"))
    head = [
        "HTTP/1.1 503 Service Unavailable",
        "content-type: application/json",
        f"content-length: {len(reply.body)}",
        "connection: close",
        *(f"{name}: {value}" for name, value in reply.headers),
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + reply.body


def accept_queue_length(sock: socket.socket) -> int:
    """Connections waiting in ``sock``'s listen backlog (Linux; 0 where unknown)."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _INFO_LEN)
    except OSError:
        return 0
    if len(info) < _INFO_LEN:
        return 0
    return int(_UNACKED.unpack_from(info, _UNACKED_OFFSET)[0])


class OverflowRefuser:
    """Answers 503 to connections left in the listen backlog of ``listen_fd`` (bound to
    ``port``) for ``grace_s`` while this process holds ``max_connections`` on the port.

    ``start()`` and ``close()`` run on the event loop; ``refused`` counts the answers sent.
    """

    def __init__(
        self, listen_fd: int, port: int, max_connections: int, grace_s: float = 0.25
    ) -> None:
        if grace_s <= 0:
            raise ValueError("grace must be positive")
        # A dup shares the listening socket (accepting from it takes a connection from the
        # same queue granian accepts from); closing it leaves granian's descriptor open.
        self._sock = socket.socket(fileno=os.dup(listen_fd))
        self._sock.setblocking(False)  # tokio's listener is non-blocking already
        self._port = port
        self._max_connections = max_connections
        self._grace_s = grace_s
        self._response = refusal_response()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._judging: asyncio.Task[None] | None = None
        self._lingering: set[socket.socket] = set()
        self.refused = 0

    @staticmethod
    def supported() -> bool:
        """Linux only: elsewhere a listening socket's queue length is not readable."""
        return sys.platform == "linux"

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._sock.fileno(), self._on_readable)

    def _on_readable(self) -> None:
        # Level-triggered: stop listening until the grace period has been judged.
        assert self._loop is not None
        self._loop.remove_reader(self._sock.fileno())
        self._arm()

    def _arm(self) -> None:
        assert self._loop is not None
        self._timer = self._loop.call_later(self._grace_s, self._start_judging)

    def _start_judging(self) -> None:
        self._timer = None
        self._judging = asyncio.create_task(self._judge(), name="frontend-overflow-judge")

    async def _judge(self) -> None:
        assert self._loop is not None
        waiting = accept_queue_length(self._sock)
        if waiting:
            held = await asyncio.to_thread(count_connections, self._port)
            if held - len(self._lingering) < self._max_connections:
                self._arm()  # granian has room and is merely late: look again
                return
        # Whatever is still queued was not taken by a full granian (a connection that arrived
        # meanwhile may be among them: the oldest go first, and all of them met a full server).
        for _ in range(waiting):
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                break  # granian took the rest
            except OSError as exc:  # EMFILE and the like: leave them to the backlog
                log.warning("could not accept a connection to refuse it: %s", exc)
                break
            self._refuse(conn)
        self._loop.add_reader(self._sock.fileno(), self._on_readable)

    def _refuse(self, conn: socket.socket) -> None:
        assert self._loop is not None
        self.refused += 1
        try:
            conn.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                while conn.recv(65536):  # what the client sent already: read, so no reset
                    pass
            conn.send(self._response)  # small: fits a fresh socket's send buffer
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            conn.close()
            return
        if len(self._lingering) >= _MAX_LINGERING:
            conn.close()
            return
        self._lingering.add(conn)
        self._loop.call_later(_LINGER_S, self._close_lingering, conn)

    def _close_lingering(self, conn: socket.socket) -> None:
        self._lingering.discard(conn)
        conn.close()

    async def close(self) -> None:
        """Stop refusing; close the dup and every refused socket still open."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._judging is not None:
            self._judging.cancel()
            await asyncio.gather(self._judging, return_exceptions=True)
            self._judging = None
        if self._loop is not None and self._sock.fileno() >= 0:
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        for conn in self._lingering:
            conn.close()
        self._lingering.clear()
