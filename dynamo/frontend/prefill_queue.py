"""Dispatch ``queue`` (spec 003): remote prefills go through a global prefill queue per model
that prefill workers *pull* from, instead of being routed to a chosen prefill worker.

The frontend pushes a :class:`PrefillTask` (the prefill-only request and where to answer) onto
the model's work queue (``DistributedRuntime.work_queue``: the in-process store in one process,
the queue this frontend hosts over its request plane on one machine, JetStream across
machines) and waits for the :class:`PrefillReply` that the worker which took it sends to this
frontend's ``prefill_reply`` endpoint. Prefill workers come and go with no coordination: each
pulls when it is free (``backend/prefill_queue.py``); one that leaves gives its unsettled task
back, and one that dies has its task given back as soon as the queue notices (the served
queue: at once, its connection to this frontend dropping; JetStream: after the redelivery
timeout).

Delivery is at least once: a task can be answered twice (redelivered while its first consumer
was slow). The first reply wins; a later one, or one for a request that stopped waiting
(cancelled, timed out), is answered ``not wanted`` and dropped. Prefill workers hold nothing
for a handoff beyond their prefix cache, so a dropped reply leaks nothing.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable

import msgspec

from dynamo.protocol.prefill_queue import (
    REPLY_COMPONENT,
    REPLY_ENDPOINT,
    PrefillReply,
    PrefillTask,
    queue_name,
)
from dynamo.protocol.request import PreprocessedRequest
from dynamo.runtime.context import Context
from dynamo.runtime.errors import (
    Cancelled,
    InvalidArgument,
    NoInstances,
    ResponseTimeout,
)
from dynamo.runtime.naming import EndpointId
from dynamo.runtime.runtime import DistributedRuntime, ServedEndpoint
from dynamo.runtime.work_queue import WorkQueue

log = logging.getLogger(__name__)

ORPHAN_GRACE_S = 3.0
"""A queued prefill fails (``NoInstances``) once no prefill worker has been live this long: no
one is left to pull it."""
_CHECK_S = 0.5

_task_encoder = msgspec.msgpack.Encoder()
_reply_decoder = msgspec.msgpack.Decoder(PrefillReply)
ACCEPTED = b"\x01"
NOT_WANTED = b"\x00"


class PrefillQueueDispatch:
    """The queue side of one frontend: its ``prefill_reply`` endpoint, a queue handle per
    model (this frontend hosts the queues where the runtime serves them) and the prefills
    waiting for a reply. Driven by the frontend's event loop only."""

    def __init__(self, runtime: DistributedRuntime) -> None:
        self._runtime = runtime
        self._queues: dict[str, WorkQueue] = {}
        self._opening: dict[str, asyncio.Lock] = {}
        self._waiting: dict[str, asyncio.Future[PrefillReply]] = {}
        self._served: ServedEndpoint | None = None

    async def start(self) -> None:
        endpoint = EndpointId(self._runtime.namespace, REPLY_COMPONENT, REPLY_ENDPOINT)
        self._served = await self._runtime.serve_endpoint(endpoint, self._on_reply)

    async def close(self) -> None:
        if self._served is not None:
            await self._runtime.unserve(self._served)
            self._served = None
        for future in self._waiting.values():
            if not future.done():
                future.cancel()
        self._waiting.clear()

    async def queue(self, model: str) -> WorkQueue:
        """``model``'s prefill queue, opened (and hosted) at its first use."""
        queue = self._queues.get(model)
        if queue is None:
            lock = self._opening.setdefault(model, asyncio.Lock())
            async with lock:
                queue = self._queues.get(model)
                if queue is None:
                    queue = await self._runtime.work_queue(queue_name(model), host=True)
                    self._queues[model] = queue
        return queue

    async def waiting(self, model: str) -> int:
        """Prefill tasks of ``model`` not yet taken by a prefill worker."""
        return (await (await self.queue(model)).depth()).waiting

    async def prefill(
        self,
        model: str,
        request: PreprocessedRequest,
        ctx: Context,
        first_response_s: float,
        live_prefill_workers: Callable[[], int],
    ) -> PrefillReply:
        """Queue ``request`` (prefill-only) and wait for its reply. Raises ``Overloaded`` (the
        queue is full), ``Cancelled`` (``ctx`` stopped), ``ResponseTimeout`` (no reply within
        ``first_response_s``; 0: no limit) or ``NoInstances`` (no prefill worker left)."""
        assert self._served is not None, "start() first"
        queue = await self.queue(model)
        task_id = uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        future: asyncio.Future[PrefillReply] = loop.create_future()
        self._waiting[task_id] = future
        stopped: asyncio.Future[None] = asyncio.ensure_future(ctx.stopped())
        try:
            task = PrefillTask(task_id=task_id, reply_to=self._served.instance_id, request=request)
            await queue.push(_task_encoder.encode(task))
            started = loop.time()
            orphaned_since: float | None = None
            while True:
                await asyncio.wait((future, stopped), timeout=_CHECK_S)
                if future.done():
                    return future.result()
                if ctx.is_stopped():
                    raise Cancelled("the request was cancelled while its prefill was queued")
                now = loop.time()
                if first_response_s > 0 and now - started > first_response_s:
                    limit = f"{first_response_s:g}s"
                    raise ResponseTimeout(f"no prefill worker answered within {limit}")
                if live_prefill_workers() > 0:
                    orphaned_since = None
                elif orphaned_since is None:
                    orphaned_since = now
                elif now - orphaned_since > ORPHAN_GRACE_S:
                    raise NoInstances(f"{model!r} has no live prefill worker to take its prefill")
        finally:
            stopped.cancel()
            self._waiting.pop(task_id, None)

    async def _on_reply(self, body: bytes, ctx: Context) -> AsyncIterator[bytes]:
        """The ``prefill_reply`` handler: the first reply for a waiting task is taken."""
        try:
            reply = _reply_decoder.decode(body)
        except msgspec.DecodeError as exc:
            raise InvalidArgument(f"malformed prefill reply: {exc}") from exc
        future = self._waiting.pop(reply.task_id, None)
        if future is None or future.done():
            log.debug("prefill reply for %s is not wanted (answered or gone)", reply.task_id)
            yield NOT_WANTED
            return
        future.set_result(reply)
        yield ACCEPTED
