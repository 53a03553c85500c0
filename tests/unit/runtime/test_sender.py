"""The write-behind thread ``Sender`` over real socket pairs: per-descriptor order,
shutdown/close markers, backlogs and their cap, dead peers, stop.

Every test runs against both implementations, the native ``dynamo.runtime._sender`` and the
pure-Python ``dynamo.runtime._sender_fallback`` (the ``impl`` fixture)."""

from __future__ import annotations

import fcntl
import gc
import os
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import FrameType

import pytest

from dynamo.runtime.sender import Sender

DEADLINE_S = 5.0  # generous: the CI machine is small and shared
SMALL_BUF = 16 * 1024  # the kernel doubles it; a few such buffers are far below the data sizes
KIB = 1024
MIB = 1024 * 1024


@dataclass(slots=True)
class Link:
    """One connection: ``fd`` is the Sender's descriptor for our end, ``peer`` the test's end."""

    fd: int
    peer: socket.socket
    ours: socket.socket | None  # our end, when the test keeps using it (``fd`` is then a dup)
    handed_over: bool = False  # close(fd) was queued (or stop closed it): the fd is not ours


@pytest.fixture(
    params=["dynamo.runtime._sender", "dynamo.runtime._sender_fallback"],
    ids=["native", "fallback"],
)
def impl(request: pytest.FixtureRequest) -> type[Sender]:
    """The Sender class under test (the native one may not be built here)."""
    sender_type: type[Sender] = pytest.importorskip(request.param).Sender
    return sender_type


@dataclass(slots=True)
class Rig:
    """Owns the Sender and the sockets of one test and cleans them up."""

    sender_type: type[Sender]
    sender: Sender | None = None
    links: list[Link] = field(default_factory=list)

    def start(self, max_backlog_bytes: int | None = None) -> Sender:
        if max_backlog_bytes is None:
            self.sender = self.sender_type()
        else:
            self.sender = self.sender_type(max_backlog_bytes=max_backlog_bytes)
        return self.sender

    def link(self, kind: str = "tcp", *, small_buffers: bool = False, keep: bool = False) -> Link:
        """A connected pair; our end is non-blocking (as the Sender requires)."""
        if kind == "tcp":
            ours, peer = tcp_pair(small_buffers=small_buffers)
        else:
            ours, peer = socket.socketpair()
        ours.setblocking(False)
        if keep:
            link = Link(os.dup(ours.fileno()), peer, ours)
        else:
            link = Link(ours.detach(), peer, None)
        self.links.append(link)
        return link

    def close(self, link: Link) -> None:
        """Queue close(fd): the descriptor is the Sender's from now on."""
        assert self.sender is not None
        self.sender.close(link.fd)
        link.handed_over = True

    def cleanup(self) -> None:
        sender = self.sender
        for link in self.links:
            if not link.handed_over:
                if sender is not None and sender.running:
                    sender.close(link.fd)
                else:
                    os.close(link.fd)
        if sender is not None:
            sender.stop(timeout=0.0)
        for link in self.links:
            link.peer.close()
            if link.ours is not None:
                link.ours.close()


@pytest.fixture
def rig(impl: type[Sender]) -> Iterator[Rig]:
    rig = Rig(impl)
    try:
        yield rig
    finally:
        rig.cleanup()


@pytest.fixture
def sigpipes() -> Iterator[list[int]]:
    """Records SIGPIPEs (Python ignores them by default, which would hide one)."""
    caught: list[int] = []

    def record(signum: int, frame: FrameType | None) -> None:
        caught.append(signum)

    previous = signal.signal(signal.SIGPIPE, record)
    try:
        yield caught
    finally:
        signal.signal(signal.SIGPIPE, previous)


def tcp_pair(*, small_buffers: bool) -> tuple[socket.socket, socket.socket]:
    """(ours, peer) over loopback TCP; small buffers make a non-reading peer block us early."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        peer = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if small_buffers:  # before connect: the receive buffer bounds the advertised window
            peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_BUF)
        peer.connect(listener.getsockname())
        ours, _ = listener.accept()
    if small_buffers:
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SMALL_BUF)
    return ours, peer


def recv_exactly(sock: socket.socket, size: int, deadline_s: float = DEADLINE_S) -> bytes:
    """``size`` bytes from ``sock``; fails on EOF or when they do not come in time."""
    buf = bytearray()
    end = time.monotonic() + deadline_s
    while len(buf) < size:
        sock.settimeout(max(0.01, end - time.monotonic()))
        chunk = sock.recv(min(size - len(buf), MIB))
        if not chunk:
            raise AssertionError(f"EOF after {len(buf)} of {size} bytes")
        buf += chunk
    return bytes(buf)


def recv_to_end(sock: socket.socket, deadline_s: float = DEADLINE_S) -> tuple[bytes, bool]:
    """Everything until the connection ends: (bytes, whether it ended with a reset)."""
    buf = bytearray()
    end = time.monotonic() + deadline_s
    while True:
        sock.settimeout(max(0.01, end - time.monotonic()))
        try:
            chunk = sock.recv(MIB)
        except ConnectionResetError:
            return bytes(buf), True
        if not chunk:
            return bytes(buf), False
        buf += chunk


def chunks(data: bytes, size: int) -> Iterator[bytes]:
    return (data[i : i + size] for i in range(0, len(data), size))


def wait_until_closed(fd: int, inode: int) -> None:
    """Poll until ``fd`` no longer refers to the socket ``inode`` (closed, maybe reused)."""
    end = time.monotonic() + DEADLINE_S
    while True:
        try:
            if os.fstat(fd).st_ino != inode:
                return
        except OSError:
            return
        if time.monotonic() > end:
            raise AssertionError(f"fd {fd} is still open")
        time.sleep(0.005)


def wait_until_stalled(peer: socket.socket) -> None:
    """Until bytes wait in ``peer`` and stop growing: its writer is blocked on a full window."""
    end = time.monotonic() + DEADLINE_S
    last = -1
    while True:
        queued = struct.unpack("i", fcntl.ioctl(peer.fileno(), termios.FIONREAD, b"\0" * 4))[0]
        if queued > 0 and queued == last:
            return
        if time.monotonic() > end:
            raise AssertionError(f"the writer never stalled ({queued} bytes queued)")
        last = queued
        time.sleep(0.02)


def wait_for_drops(sender: Sender, count: int, deadline_s: float = DEADLINE_S) -> None:
    end = time.monotonic() + deadline_s
    while sender.dropped_connections < count:
        if time.monotonic() > end:
            raise AssertionError(f"dropped_connections {sender.dropped_connections} < {count}")
        time.sleep(0.005)


# ---------------------------------------------------------------------------- order


def test_many_sends_arrive_in_order_after_one_flush(rig: Rig) -> None:
    sender = rig.start()
    link = rig.link()
    parts = [os.urandom(i % 700) for i in range(2000)]  # includes empty sends
    for part in parts:
        sender.send(link.fd, part)
    sender.flush()
    expected = b"".join(parts)
    assert recv_exactly(link.peer, len(expected)) == expected
    assert sender.dropped_connections == 0


def test_interleaved_descriptors_each_keep_their_own_order(rig: Rig) -> None:
    sender = rig.start()
    tcp, unix = rig.link("tcp"), rig.link("unix")
    sent: dict[int, list[bytes]] = {tcp.fd: [], unix.fd: []}
    for i in range(1000):
        for link in (tcp, unix):
            part = b"%d:%d;" % (link.fd, i)
            sender.send(link.fd, part)
            sent[link.fd].append(part)
        if i % 97 == 0:
            sender.flush()  # some batches hit a thread that is still busy
    sender.flush()
    for link in (tcp, unix):
        expected = b"".join(sent[link.fd])
        assert recv_exactly(link.peer, len(expected)) == expected


def test_every_flush_wakes_a_sleeping_thread(rig: Rig) -> None:
    # Ping-pong: each message is written only if its flush woke the thread (no lost wake-up).
    sender = rig.start()
    link = rig.link("unix")
    for i in range(1000):
        message = b"%06d" % i
        sender.send(link.fd, message)
        sender.flush()
        assert recv_exactly(link.peer, len(message)) == message


def test_sent_data_is_copied_at_send(rig: Rig) -> None:
    sender = rig.start()
    link = rig.link()
    buf = bytearray(b"before")
    sender.send(link.fd, buf)
    buf[:] = b"AFTER!"
    sender.flush()
    assert recv_exactly(link.peer, 6) == b"before"


# -------------------------------------------------------------------------- markers


@pytest.mark.parametrize("kind", ["tcp", "unix"])
def test_close_marker_follows_the_bytes(rig: Rig, kind: str) -> None:
    sender = rig.start()
    link = rig.link(kind)
    data = os.urandom(300 * KIB)
    for part in chunks(data, 10 * KIB):
        sender.send(link.fd, part)
    rig.close(link)
    sender.flush()
    assert recv_to_end(link.peer) == (data, False)


def test_shutdown_write_half_closes_after_the_bytes(rig: Rig) -> None:
    sender = rig.start()
    link = rig.link(keep=True)
    assert link.ours is not None
    sender.send(link.fd, b"last words")
    sender.shutdown_write(link.fd)
    sender.flush()
    assert recv_to_end(link.peer) == (b"last words", False)
    # Only our sending direction is shut: the peer can still talk to us.
    link.peer.sendall(b"still listening?")
    assert recv_exactly(link.ours, 16) == b"still listening?"
    assert sender.dropped_connections == 0


# -------------------------------------------------------------------------- backlog


def test_backlogged_descriptor_loses_nothing_and_blocks_no_other(rig: Rig) -> None:
    sender = rig.start()
    slow = rig.link(small_buffers=True)
    fast = rig.link()
    data = os.urandom(4 * MIB)
    fast_parts = []
    for i, part in enumerate(chunks(data, 64 * KIB)):
        sender.send(slow.fd, part)
        if i % 8 == 0:  # the fast descriptor's bytes sit between the slow one's in the queue
            fast_parts.append(b"fast %d;" % i)
            sender.send(fast.fd, fast_parts[-1])
    sender.flush()
    # The slow peer has read nothing, so its descriptor is stuck; the fast one still flows.
    expected_fast = b"".join(fast_parts)
    assert recv_exactly(fast.peer, len(expected_fast)) == expected_fast
    sender.send(fast.fd, b"and more")
    sender.flush()
    assert recv_exactly(fast.peer, 8) == b"and more"
    # Now the slow peer reads: every byte, in order; later bytes follow them.
    assert recv_exactly(slow.peer, len(data)) == data
    sender.send(slow.fd, b"tail")
    rig.close(slow)
    sender.flush()
    assert recv_to_end(slow.peer) == (b"tail", False)
    assert sender.dropped_connections == 0


def test_backlog_over_the_cap_drops_the_connection(rig: Rig) -> None:
    sender = rig.start(max_backlog_bytes=64 * KIB)
    link = rig.link(small_buffers=True)
    other = rig.link()
    data = os.urandom(3 * MIB // 2)
    for i, part in enumerate(chunks(data, 16 * KIB)):
        sender.send(link.fd, part)
        if i % 8 == 7:
            sender.flush()  # the cap is crossed across several batches: counted once
    sender.flush()
    wait_for_drops(sender, 1)
    # Shut down both ways before any close: the peer sees its connection end after a prefix.
    received, _ = recv_to_end(link.peer)
    assert len(received) < len(data) and data.startswith(received)
    # Later bytes for the dead descriptor vanish quietly; its close marker is still performed.
    inode = os.fstat(link.fd).st_ino
    sender.send(link.fd, b"x" * (256 * KIB))
    sender.shutdown_write(link.fd)
    fd = link.fd
    rig.close(link)
    sender.flush()
    wait_until_closed(fd, inode)
    assert sender.dropped_connections == 1
    # The cap is per descriptor: another one still works.
    sender.send(other.fd, b"fine")
    sender.flush()
    assert recv_exactly(other.peer, 4) == b"fine"


def test_a_single_send_over_the_cap_drops_the_connection(rig: Rig) -> None:
    # One response larger than the cap to a peer that never reads: the backlog is past the
    # cap as soon as the kernel takes what it can, with nothing else queued for the fd.
    sender = rig.start(max_backlog_bytes=64 * KIB)
    link = rig.link(small_buffers=True)
    sender.send(link.fd, os.urandom(MIB))
    sender.flush()
    wait_for_drops(sender, 1)  # with no further send (only the deadline is for a hang)


# ------------------------------------------------------------------------ dead peers


def close_counted_once(rig: Rig, link: Link, sender: Sender, sigpipes: list[int]) -> None:
    """Hand the dropped descriptor's close to the sender: it is closed, counted once, quietly."""
    inode = os.fstat(link.fd).st_ino
    fd = link.fd
    rig.close(link)
    sender.flush()
    wait_until_closed(fd, inode)
    assert sender.dropped_connections == 1
    assert sigpipes == []


@pytest.mark.parametrize("how", ["tcp peer closed", "unix peer closed", "after shutdown_write"])
def test_a_gone_peer_is_counted_without_sigpipe(rig: Rig, sigpipes: list[int], how: str) -> None:
    sender = rig.start()
    link = rig.link("unix" if how.startswith("unix") else "tcp")
    if how == "after shutdown_write":
        sender.shutdown_write(link.fd)  # a later write is EPIPE: SIGPIPE unless suppressed
    else:
        link.peer.close()
    end = time.monotonic() + DEADLINE_S
    while sender.dropped_connections == 0:  # a TCP peer's reset comes after our first write
        assert time.monotonic() < end, "the write error was not counted"
        sender.send(link.fd, b"x" * 1000)
        sender.flush()
        time.sleep(0.002)
    for _ in range(20):  # a dead descriptor takes more bytes quietly, counted once
        sender.send(link.fd, b"y" * 1000)
    close_counted_once(rig, link, sender, sigpipes)


def test_a_peer_gone_while_backlogged_is_counted(rig: Rig, sigpipes: list[int]) -> None:
    sender = rig.start()
    link = rig.link(small_buffers=True)
    for part in chunks(os.urandom(MIB), 64 * KIB):
        sender.send(link.fd, part)
    sender.flush()
    wait_until_stalled(link.peer)  # the thread polls the backlogged descriptor now
    link.peer.close()  # with unread bytes: a reset, which the backlog's poll sees
    wait_for_drops(sender, 1)
    close_counted_once(rig, link, sender, sigpipes)


# A dead descriptor's queue, in a child process: a use-after-free there aborts the process.
DEAD_DESCRIPTOR_CHILD = r"""
import os, socket, sys, time
from dynamo.runtime.sender import Sender

if sys.argv[1] == "peer gone":
    sender = Sender()
    ours, peer = socket.socketpair()
    peer.close()  # the first write fails: the descriptor is dead from then on
else:  # "over the cap": a peer that never reads, on small buffers
    sender = Sender(max_backlog_bytes=64 * 1024)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        peer = socket.socket()
        peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
        peer.connect(listener.getsockname())
        ours, _ = listener.accept()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 * 1024)
ours.setblocking(False)
inode = os.fstat(ours.fileno()).st_ino
fd = ours.detach()
for _ in range(64):  # 1 MiB: the descriptor dies early, later chunks hit its dead queue
    sender.send(fd, b"x" * 16384)
sender.close(fd)
sender.flush()
end = time.monotonic() + 5.0
while time.monotonic() < end:
    try:
        if os.fstat(fd).st_ino != inode:
            break
    except OSError:
        break
    time.sleep(0.005)
else:
    print("the close marker was never performed: fd still open")
    sys.exit(1)
print("closed", sender.dropped_connections)
sender.stop(0.0)
peer.close()
"""


@pytest.mark.parametrize("how", ["peer gone", "over the cap"])
def test_bytes_for_a_dead_descriptor_are_dropped_and_its_close_performed(
    how: str, impl: type[Sender]
) -> None:
    native = "1" if impl.__module__ == "dynamo.runtime._sender" else "0"
    child = subprocess.run(
        [sys.executable, "-c", DEAD_DESCRIPTOR_CHILD, how],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env=os.environ | {"DYN_NATIVE": native},
    )
    report = f"rc={child.returncode} stdout={child.stdout!r} stderr={child.stderr[-2000:]!r}"
    assert (child.returncode, child.stdout) == (0, "closed 1\n"), report


# ----------------------------------------------------------------------------- stop


def test_stop_finishes_the_queue_and_waits_for_a_slow_reader(rig: Rig) -> None:
    sender = rig.start()
    link = rig.link(small_buffers=True)
    data = os.urandom(4 * MIB)
    for part in chunks(data, 64 * KIB):
        sender.send(link.fd, part)
    rig.close(link)  # no flush: stop itself finishes the queue
    go = threading.Event()
    got: list[tuple[bytes, bool]] = []

    def read() -> None:
        go.wait()
        time.sleep(0.1)  # start reading only once stop waits on the backlog
        got.append(recv_to_end(link.peer, 20.0))

    reader = threading.Thread(target=read, name="slow-reader")
    reader.start()
    go.set()
    started = time.monotonic()
    sender.stop(timeout=30.0)
    elapsed = time.monotonic() - started
    reader.join(25.0)
    assert got == [(data, False)]
    assert elapsed < 10.0  # stop waits only as long as the reader needs
    assert not sender.running


def test_stop_gives_up_on_a_stalled_peer(rig: Rig) -> None:
    sender = rig.start()
    link = rig.link(small_buffers=True)
    data = os.urandom(MIB)
    for part in chunks(data, 64 * KIB):
        sender.send(link.fd, part)
    sender.flush()
    started = time.monotonic()
    sender.stop(timeout=0.3)
    elapsed = time.monotonic() - started
    link.handed_over = True  # stop closed the backlogged descriptor
    assert 0.28 <= elapsed < 3.0
    assert not sender.running
    received, _ = recv_to_end(link.peer)  # ends: the descriptor was closed
    assert len(received) < len(data) and data.startswith(received)


def test_a_stopped_sender_refuses_new_work(rig: Rig) -> None:
    sender = rig.start()
    link = rig.link()
    assert sender.running
    sender.send(link.fd, b"before stop")
    rig.close(link)
    sender.stop()
    assert not sender.running
    assert recv_to_end(link.peer) == (b"before stop", False)
    spare = rig.link()
    with pytest.raises(RuntimeError):
        sender.send(spare.fd, b"after stop")
    with pytest.raises(RuntimeError):
        sender.shutdown_write(spare.fd)
    with pytest.raises(RuntimeError):
        sender.close(spare.fd)
    sender.flush()  # harmless
    sender.stop(timeout=0.0)  # twice is fine
    assert not sender.running
    assert sender.dropped_connections == 0


def test_dropping_the_sender_finishes_its_queue(impl: type[Sender]) -> None:
    ours, peer = tcp_pair(small_buffers=False)
    with peer:
        ours.setblocking(False)
        fd = ours.detach()
        sender = impl()
        sender.send(fd, b"queued, never flushed")
        sender.close(fd)
        del sender  # dealloc stops the thread, which finishes the queue first
        gc.collect()
        assert recv_to_end(peer) == (b"queued, never flushed", False)


# ------------------------------------------------------------------------ arguments


def test_argument_errors_and_bytes_like_data(rig: Rig) -> None:
    sender = rig.start()
    link = rig.link()
    for method in (sender.close, sender.shutdown_write):
        with pytest.raises(ValueError):
            method(-1)
    with pytest.raises(ValueError):
        sender.send(-1, b"x")
    with pytest.raises(ValueError):
        sender.send(2**31, b"x")
    with pytest.raises(TypeError):
        sender.send("3", b"x")  # type: ignore[arg-type]
    for bad in ("text", 5, None, [1, 2]):
        with pytest.raises(TypeError):
            sender.send(link.fd, bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        sender.send(link.fd)  # type: ignore[call-arg]
    with pytest.raises(BufferError):
        sender.send(link.fd, memoryview(b"abcdef")[::2])  # not contiguous
    for cap in (0, -1):
        with pytest.raises(ValueError):
            rig.sender_type(max_backlog_bytes=cap)
    with pytest.raises(TypeError):
        sender.stop(timeout="soon")  # type: ignore[arg-type]
    assert sender.running
    # Bytes-like data is accepted; the refused calls queued nothing.
    sender.send(link.fd, b"bytes|")
    sender.send(link.fd, bytearray(b"bytearray|"))
    sender.send(link.fd, memoryview(b"--memoryview|--")[2:-2])
    rig.close(link)
    sender.flush()
    assert recv_to_end(link.peer) == (b"bytes|bytearray|memoryview|", False)
    assert sender.dropped_connections == 0
