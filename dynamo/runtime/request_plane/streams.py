"""Transport-independent halves of one request-plane stream, shared by the local and TCP planes.

Server side: :func:`run_handler` drives a handler into an :class:`Outbox` (data frames, then
``complete_final`` or a typed error). Client side: :func:`iterate` drains an :class:`Inbox`.

Flow control (the backpressure contract of ``base.py``) is a per-stream credit window counted in
frames, as in HTTP/2: the server starts with ``window`` credits, spends one per data frame and,
at zero, stops pulling from the handler (its ``yield`` blocks) until the client grants more. The
client grants credits only for frames its consumer has *taken*, in batches of ``window // 2``.
So at most ``window`` frames of a stream are ever buffered between the handler and a slow
consumer, on either side; terminal frames need no credit.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator

from dynamo.runtime.context import Context
from dynamo.runtime.errors import DynamoError
from dynamo.runtime.request_plane.base import Handler

log = logging.getLogger(__name__)

DEFAULT_WINDOW = 128
"""Frames a stream may have in flight ahead of its consumer."""


class Outbox(ABC):
    """Server-side sink of one stream. Transports implement ``send*``; credits live here.

    ``reset`` means the client is gone (it stopped reading or the connection dropped): the handler
    is drained to its end but nothing more is sent, and credit waits end at once.
    """

    __slots__ = ("credit", "reset", "_loop", "_waiter")

    def __init__(self, window: int, loop: asyncio.AbstractEventLoop) -> None:
        self.credit = window
        self.reset = False
        self._loop = loop  # kept: get_running_loop() costs a getpid() syscall per call
        self._waiter: asyncio.Future[None] | None = None

    @abstractmethod
    def send(self, body: bytes) -> None: ...

    @abstractmethod
    def send_final(self) -> None: ...

    @abstractmethod
    def send_error(self, kind: str, message: str) -> None: ...

    def blocked(self) -> bool:
        """True when the transport asks the producer to wait (besides credits)."""
        return False

    async def wait_ready(self) -> None:
        """Wait until a frame may be sent (credit available) or the stream was reset."""
        while self.credit <= 0 and not self.reset:
            waiter = self._waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                self._waiter = None

    def add_credit(self, n: int) -> None:
        self.credit += n
        self._wake()

    def reset_stream(self) -> None:
        self.reset = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


def _as_bytes(item: object) -> bytes:
    if isinstance(item, bytes | bytearray | memoryview):
        return bytes(item)
    raise TypeError(f"handler yielded {type(item).__name__}, expected bytes")


async def run_handler(handler: Handler, body: bytes, ctx: Context, out: Outbox) -> None:
    """Serve one stream: every body the handler yields becomes a data frame; a normal end sends
    ``complete_final``; a :class:`DynamoError` becomes a typed error frame and any other exception
    an ``Unknown`` one. Cancellation (server stop) propagates; the caller reports the stream as
    incomplete. The handler is always closed."""
    agen: AsyncIterator[bytes] | None = None
    try:
        agen = handler(body, ctx)
        async for item in agen:
            if out.reset:
                continue  # nobody reads any more; let the handler run to its (cancelled) end
            out.send(item if type(item) is bytes else _as_bytes(item))
            out.credit -= 1
            if out.credit <= 0 or out.blocked():
                await out.wait_ready()
        if not out.reset:
            out.send_final()
    except DynamoError as exc:
        if not out.reset:
            out.send_error(exc.kind, exc.message)
    except Exception as exc:
        log.warning("request handler failed (request %s)", ctx.id, exc_info=True)
        if not out.reset:
            out.send_error("Unknown", f"{type(exc).__name__}: {exc}")
    finally:
        aclose = getattr(agen, "aclose", None)
        if aclose is not None:
            await aclose()


class Inbox(ABC):
    """Client-side buffer of one stream: the transport pushes, :func:`iterate` drains.

    Subclasses open the stream (``open``), forward credits (``grant``), tell the server when the
    consumer leaves early (``abandon``) and free per-stream state (``release``).
    """

    __slots__ = ("items", "ended", "error", "loop", "_waiter", "_unacked", "_grant_every")

    def __init__(self, window: int) -> None:
        self.items: deque[bytes] = deque()
        self.ended = False
        self.error: DynamoError | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # set by open()
        self._waiter: asyncio.Future[None] | None = None
        self._unacked = 0
        self._grant_every = max(1, window // 2)

    @abstractmethod
    async def open(self) -> None:
        """Send the request; set ``loop``. Raises CannotConnect & co. if the stream can't start."""

    @abstractmethod
    def grant(self, n: int) -> None: ...

    @abstractmethod
    def abandon(self) -> None: ...

    def release(self) -> None:  # noqa: B027 - optional hook: most transports keep no state
        """Free per-stream transport state (default: nothing to free)."""

    # -- transport side --------------------------------------------------------------------
    def push(self, body: bytes) -> None:
        self.items.append(body)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def finish(self) -> None:
        self.ended = True
        self._wake()

    def fail(self, exc: DynamoError) -> None:
        if not self.ended:
            self.ended = True
            self.error = exc
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- consumer side ---------------------------------------------------------------------
    def take(self) -> bytes:
        body = self.items.popleft()
        self._unacked += 1
        if self._unacked >= self._grant_every and not self.ended:
            self.grant(self._unacked)
            self._unacked = 0
        return body

    async def wait(self) -> None:
        loop = self.loop or asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None


async def iterate(inbox: Inbox) -> AsyncGenerator[bytes, None]:
    """Open ``inbox`` and yield its bodies; raise its typed error at the end, if any.

    Leaving early (``break`` + ``aclose``, cancellation, garbage collection) abandons the stream,
    which makes the server kill the handler's context and send nothing more.
    """
    await inbox.open()
    try:
        items = inbox.items
        while True:
            if items:
                yield inbox.take()
            elif inbox.ended:
                break
            else:
                await inbox.wait()
        if inbox.error is not None:
            raise inbox.error
    finally:
        if not inbox.ended:
            inbox.abandon()
        inbox.release()


async def iterate_batches(inbox: Inbox) -> AsyncGenerator[list[bytes], None]:
    """Like :func:`iterate`, but yield every body already received at once (never empty).

    A consumer that falls behind then handles a burst in one go (one decode loop, one write to
    its own client) instead of paying per-item overhead for each body. Not built on top of
    :func:`iterate` or the other way round: credit goes back as bodies are *taken*, so each
    keeps its own granularity of backpressure (per body there, per burst here).
    """
    await inbox.open()
    try:
        items = inbox.items
        take = inbox.take
        while True:
            if items:
                yield [take() for _ in range(len(items))]
            elif inbox.ended:
                break
            else:
                await inbox.wait()
        if inbox.error is not None:
            raise inbox.error
    finally:
        if not inbox.ended:
            inbox.abandon()
        inbox.release()
