"""Pure-Python ``Sender``: the write-behind contract of ``_sender.c`` without C.

Used where ``_sender.c`` is not built or ``DYN_NATIVE=0`` (see ``dynamo.native``). Same contract
(see ``_sender.c``'s header): the owner hands over a descriptor of its own and sends every byte
for it here; bytes of one descriptor keep their order and its shutdown/close markers follow the
bytes queued before them; a descriptor whose peer does not read is backlogged and polled for
POLLOUT, and shut down both ways once more than ``max_backlog_bytes`` of its bytes wait; write
errors drop the descriptor's bytes until its close marker. The thread writes with the GIL
released only inside each system call, so this keeps behaviour, not the native speed.
"""

from __future__ import annotations

import math
import os
import select
import socket
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Final

_DATA: Final = 0
_SHUTDOWN_WRITE: Final = 1
_CLOSE: Final = 2
_INT_MAX: Final = 2**31 - 1
_MAX_STOP_S: Final = 86400.0  # a day is "forever" here


@dataclass(slots=True)
class _Node:
    fd: int
    op: int
    data: bytes = b""
    off: int = 0  # bytes of data already written


@dataclass(slots=True)
class _Backlog:
    """A descriptor with bytes the kernel would not take yet, or whose peer is gone."""

    fd: int
    nodes: deque[_Node] = field(default_factory=deque)
    bytes: int = 0
    dead: bool = False  # write failed or over the cap: drop data until the close marker


def _as_fd(fd: object) -> int:
    if not isinstance(fd, int):
        raise TypeError(f"a file descriptor must be int, not {type(fd).__name__}")
    if fd < 0 or fd > _INT_MAX:
        raise ValueError(f"not a file descriptor: {fd}")
    return fd


def _wrap(fd: int) -> socket.socket | None:
    """A socket object over ``fd`` (which stays ours: detach it, never close it), or None."""
    try:
        return socket.socket(fileno=fd)
    except OSError:
        return None  # not a socket (or already closed)


def _write(node: _Node, sock: socket.socket | None) -> int:
    """Write the node's remaining data: 0 done, 1 the kernel would block, -1 failed."""
    view = memoryview(node.data)
    while node.off < len(node.data):
        try:
            if sock is not None:
                # MSG_NOSIGNAL: a gone peer is an EPIPE here, never a SIGPIPE for the process.
                node.off += sock.send(view[node.off :], socket.MSG_NOSIGNAL)
            else:
                node.off += os.write(node.fd, view[node.off :])
        except BlockingIOError:
            return 1
        except OSError:  # the peer is gone
            return -1
    return 0


class _Worker:
    """The thread's state; the Sender owns it, the thread holds no reference to the Sender."""

    def __init__(self, max_backlog_bytes: int) -> None:
        self.lock = threading.Lock()
        self.max_backlog_bytes = max_backlog_bytes
        # Guarded by lock.
        self.queue: deque[_Node] = deque()
        self.sleeping = False
        self.stopping = False
        self.stop_deadline = 0.0
        self.dropped_connections = 0
        # Owned by the thread.
        self.backlogs: dict[int, _Backlog] = {}
        self.sockets: dict[int, socket.socket | None] = {}  # fd -> its socket object, until close
        self.wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def wake(self) -> None:
        try:
            os.eventfd_write(self.wake_fd, 1)
        except OSError:
            pass

    # ---------------------------------------------------------------- the thread

    def _socket(self, fd: int) -> socket.socket | None:
        try:
            return self.sockets[fd]
        except KeyError:
            sock = self.sockets[fd] = _wrap(fd)
            return sock

    def _shutdown(self, fd: int, how: int) -> None:
        sock = self._socket(fd)
        if sock is not None:
            try:
                sock.shutdown(how)
            except OSError:
                pass

    def _close(self, fd: int) -> None:
        sock = self.sockets.pop(fd, None)
        if sock is not None:
            sock.detach()
        try:
            os.close(fd)
        except OSError:
            pass

    def run(self) -> None:
        while True:
            with self.lock:
                batch, self.queue = self.queue, deque()
                stopping, deadline = self.stopping, self.stop_deadline
                if not batch:
                    if stopping and (not self.backlogs or time.monotonic() >= deadline):
                        break
                    self.sleeping = True
            if batch:
                self._handle(batch)
                continue
            timeout_ms = -1
            if stopping:
                timeout_ms = max(0, math.ceil((deadline - time.monotonic()) * 1000))
            self._wait(timeout_ms)
            with self.lock:
                self.sleeping = False
        for backlog in list(self.backlogs.values()):  # stopped: backlogged ones lose bytes
            self._close(backlog.fd)
        self.backlogs.clear()
        for sock in self.sockets.values():  # descriptors still their owner's: not closed
            if sock is not None:
                sock.detach()
        self.sockets.clear()

    def _handle(self, batch: deque[_Node]) -> None:
        for node in batch:
            backlog = self.backlogs.get(node.fd)
            if backlog is None:
                self._perform(node)
                continue
            self._append(backlog, node)
            if backlog.bytes > self.max_backlog_bytes:
                self._kill(backlog)
            if backlog.dead:
                self._drain(backlog)  # drops data; performs a close marker

    def _perform(self, node: _Node) -> None:
        """A node for a descriptor without a backlog."""
        if node.op == _SHUTDOWN_WRITE:
            self._shutdown(node.fd, socket.SHUT_WR)
        elif node.op == _CLOSE:
            self._close(node.fd)
        else:
            rc = _write(node, self._socket(node.fd))
            if rc == 0:
                return
            backlog = self.backlogs[node.fd] = _Backlog(node.fd)
            self._append(backlog, node)
            if rc < 0 or backlog.bytes > self.max_backlog_bytes:
                self._kill(backlog)

    @staticmethod
    def _append(backlog: _Backlog, node: _Node) -> None:
        backlog.nodes.append(node)
        if node.op == _DATA:
            backlog.bytes += len(node.data) - node.off

    def _kill(self, backlog: _Backlog) -> None:
        """Drop every byte (keeping a close marker): the connection is over."""
        backlog.nodes = deque(n for n in backlog.nodes if n.op == _CLOSE)
        backlog.bytes = 0
        if not backlog.dead:
            backlog.dead = True
            self._shutdown(backlog.fd, socket.SHUT_RDWR)
            with self.lock:
                self.dropped_connections += 1

    def _drain(self, backlog: _Backlog) -> None:
        """Write what the kernel takes now; the backlog goes once caught up or closed."""
        nodes = backlog.nodes
        while nodes:
            node = nodes[0]
            if node.op == _DATA:
                if not backlog.dead:
                    before = node.off
                    rc = _write(node, self._socket(node.fd))
                    backlog.bytes -= node.off - before
                    if rc > 0:
                        return
                    if rc < 0:
                        self._kill(backlog)
                        nodes = backlog.nodes
                        continue
            elif node.op == _SHUTDOWN_WRITE:
                if not backlog.dead:
                    self._shutdown(node.fd, socket.SHUT_WR)
            else:
                self._close(node.fd)
                del self.backlogs[backlog.fd]  # nothing can follow a close
                return
            nodes.popleft()
        if not backlog.dead:
            del self.backlogs[backlog.fd]  # caught up: later nodes are written directly

    def _wait(self, timeout_ms: int) -> None:
        poller = select.poll()
        poller.register(self.wake_fd, select.POLLIN)
        for backlog in self.backlogs.values():
            if not backlog.dead:
                poller.register(backlog.fd, select.POLLOUT)
        for fd, events in poller.poll(timeout_ms):
            if fd == self.wake_fd:
                try:
                    os.eventfd_read(self.wake_fd)
                except OSError:
                    pass
                continue
            waiting = self.backlogs.get(fd)
            if waiting is not None:
                if events & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
                    self._kill(waiting)
                self._drain(waiting)


class Sender:
    """A write-behind thread writing to sockets (contract: ``_sender.pyi`` / ``_sender.c``)."""

    __slots__ = ("_worker", "_thread", "__weakref__")

    def __init__(self, max_backlog_bytes: int = 16 * 1024 * 1024) -> None:
        if not isinstance(max_backlog_bytes, int):
            raise TypeError("max_backlog_bytes must be int")
        if max_backlog_bytes <= 0:
            raise ValueError("max_backlog_bytes must be positive")
        self._worker = _Worker(max_backlog_bytes)
        self._thread: threading.Thread | None = threading.Thread(
            target=self._worker.run, name="dynamo-sender", daemon=True
        )
        self._thread.start()
        # Dropping the Sender stops the thread, which finishes the queue first (as dealloc).
        weakref.finalize(self, _stop, self._worker, self._thread, 0.0)

    def _enqueue(self, node: _Node) -> None:
        worker = self._worker
        with worker.lock:
            if worker.stopping:
                raise RuntimeError("Sender is stopped")
            worker.queue.append(node)

    def send(self, fd: int, data: bytes | bytearray | memoryview) -> None:
        """Queue a copy of ``data`` for ``fd``."""
        fd = _as_fd(fd)
        with memoryview(data) as view:
            if not view.c_contiguous:
                raise BufferError("memoryview: underlying buffer is not C-contiguous")
            copy = view.tobytes()
        self._enqueue(_Node(fd, _DATA, copy))

    def shutdown_write(self, fd: int) -> None:
        """Queue ``shutdown(fd, SHUT_WR)`` after the bytes queued before it."""
        self._enqueue(_Node(_as_fd(fd), _SHUTDOWN_WRITE))

    def close(self, fd: int) -> None:
        """Queue ``close(fd)`` after everything queued before it; ``fd`` is the Sender's now."""
        self._enqueue(_Node(_as_fd(fd), _CLOSE))

    def flush(self) -> None:
        """Wake the thread if it sleeps with work queued."""
        worker = self._worker
        with worker.lock:
            asleep_with_work = worker.sleeping and bool(worker.queue)
            if asleep_with_work:
                worker.sleeping = False  # one wake-up is enough until it sleeps again
        if asleep_with_work:
            worker.wake()

    def stop(self, timeout: float = 1.0) -> None:
        """Finish the queue, wait up to ``timeout`` s for slow peers, close the rest, join."""
        if not isinstance(timeout, int | float):
            raise TypeError(f"timeout must be a number, not {type(timeout).__name__}")
        thread, self._thread = self._thread, None
        if thread is not None:
            _stop(self._worker, thread, float(timeout))

    @property
    def dropped_connections(self) -> int:
        with self._worker.lock:
            return self._worker.dropped_connections

    @property
    def running(self) -> bool:
        return self._thread is not None


def _stop(worker: _Worker, thread: threading.Thread, timeout_s: float) -> None:
    if not thread.is_alive() and worker.wake_fd < 0:
        return
    if not timeout_s >= 0.0:  # negative or NaN
        timeout_s = 0.0
    timeout_s = min(timeout_s, _MAX_STOP_S)
    with worker.lock:
        if not worker.stopping:
            worker.stopping = True
            worker.stop_deadline = time.monotonic() + timeout_s
    worker.wake()
    thread.join()
    if worker.wake_fd >= 0:
        os.close(worker.wake_fd)  # nothing waits on it any more
        worker.wake_fd = -1
