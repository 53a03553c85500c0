"""Closes the frontend's client connections that never send a request.

granian (hyper) times out a request's headers once their first byte arrived and closes
keep-alive connections idle for that long, but a connection that sends *nothing* after the TCP
handshake is kept forever, and each holds one of granian's connection places
(``backpressure``): 1,024 such sockets stopped the old frontend. granian offers no hook for it,
so this sweep does it from the outside, on Linux: every few seconds, in a thread, it looks at
this process's sockets (``/proc/self/fd``), and shuts down each connection to the HTTP port that
has received nothing for ``idle_s`` (``TCP_INFO.tcpi_last_data_recv``), sent nothing either, and
has no request in progress (peers with a request in the handler are skipped). hyper then sees
the connection end and frees its place. Everything is checked on a dup of the descriptor, so a
descriptor number reused meanwhile is judged by what it is now.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
from collections.abc import Callable, Collection, Iterator

log = logging.getLogger(__name__)

_PROC_FD = "/proc/self/fd"
_TCP_INFO = getattr(socket, "TCP_INFO", 11)
# struct tcp_info: 8 one-byte fields, 9 u32 (rto .. fackets), then last_data_sent,
# last_ack_sent, last_data_recv (milliseconds ago).
_TIMES = struct.Struct("=III")
_TIMES_OFFSET = 8 + 9 * 4
_INFO_LEN = _TIMES_OFFSET + _TIMES.size

Peer = tuple[str, int]


def parse_peer(client: str) -> Peer | None:
    """granian's ``scope.client`` (``host:port``, IPv6 maybe bracketed) as a peer tuple."""
    host, sep, port = client.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def served_connections(port: int) -> Iterator[tuple[socket.socket, Peer]]:
    """This process's accepted TCP connections on local ``port``, each as a dup of its
    descriptor (closed when the iteration moves on) and its peer. Blocking: off the loop."""
    for name in os.listdir(_PROC_FD):
        try:
            if not os.readlink(f"{_PROC_FD}/{name}").startswith("socket:"):
                continue
            fd = os.dup(int(name))
        except (OSError, ValueError):
            continue  # closed meanwhile
        sock = socket.socket(fileno=fd)
        try:
            if sock.type != socket.SOCK_STREAM or sock.family not in (
                socket.AF_INET,
                socket.AF_INET6,
            ):
                continue
            if sock.getsockname()[1] != port:
                continue
            peer = sock.getpeername()  # OSError for the listener
            yield sock, (peer[0], peer[1])
        except OSError:
            continue
        finally:
            sock.close()  # closes our dup only


def count_connections(port: int) -> int:
    """How many accepted connections this process holds on local ``port``."""
    return sum(1 for _ in served_connections(port))


def reap_idle(port: int, idle_s: float, active: Collection[Peer]) -> int:
    """Shut down this process's idle client connections to ``port``; returns how many."""
    idle_ms = int(idle_s * 1000)
    reaped = 0
    for sock, peer in served_connections(port):
        if peer in active:
            continue
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _INFO_LEN)
            if len(info) < _INFO_LEN:
                continue
            sent_ago, _, received_ago = _TIMES.unpack_from(info, _TIMES_OFFSET)
            if received_ago >= idle_ms and sent_ago >= idle_ms:
                sock.shutdown(socket.SHUT_RDWR)
                reaped += 1
        except OSError:
            continue
    return reaped


class IdleReaper:
    """Runs :func:`reap_idle` every ``idle_s / 2`` seconds until cancelled (one task)."""

    def __init__(self, port: int, idle_s: float, active: Callable[[], Collection[Peer]]) -> None:
        self._port = port
        self._idle_s = idle_s
        self._active = active
        self.reaped = 0

    @staticmethod
    def supported() -> bool:
        return os.path.isdir(_PROC_FD)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(max(0.05, self._idle_s / 2))
            active = frozenset(self._active())
            try:
                count = await asyncio.to_thread(reap_idle, self._port, self._idle_s, active)
            except OSError as exc:  # e.g. /proc unreadable: give up quietly
                log.warning("idle connection sweep stopped: %s", exc)
                return
            if count:
                self.reaped += count
                log.info("closed %d client connections that sent nothing", count)
