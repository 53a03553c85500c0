"""A prefill worker's side of the global prefill queue (dispatch ``queue``, spec 003).

Every prefill engine pulls its model's prefill tasks (``protocol/prefill_queue.py``) from the
runtime's work queue, one at a time: it takes a task only when it is free, so the queue
balances the prefill workers by itself and a worker joins or leaves with no coordination.
A task runs through the engine's :class:`EngineAdapter` like a routed request (cancellation,
stream validation, metrics, spans); its terminal chunk (the handoff) or its typed error goes
to the frontend that queued it (``{namespace}.frontend.prefill_reply``, instance ``reply_to``),
and only then is the task acknowledged. A frontend that is gone or no longer waits is not an
error: the reply is dropped (the handoff holds nothing beyond the prefix cache).

An engine that is shutting down (``EngineShutdown``/``WorkerShutdown``) gives the task back and
the consumer stops pulling. Leaving (:meth:`PrefillQueueConsumer.stop`): no new pull; the task
in hand may finish within the grace period; one still running after it is cut short and given
back to the queue (the runtime closes the queue handle, which gives back unsettled items) for
another worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import msgspec

from dynamo.backend.adapter import EngineAdapter
from dynamo.protocol.prefill_queue import (
    REPLY_COMPONENT,
    REPLY_ENDPOINT,
    PrefillReply,
    PrefillTask,
    queue_name,
)
from dynamo.runtime.client import EndpointClient
from dynamo.runtime.context import Context
from dynamo.runtime.errors import DynamoError, EngineShutdown, WorkerShutdown
from dynamo.runtime.naming import EndpointId
from dynamo.runtime.runtime import DistributedRuntime
from dynamo.runtime.work_queue import WorkItem, WorkQueue

log = logging.getLogger(__name__)

PULL_SLICE_S = 0.5  # a pull's wait, so that stop() is noticed
REPLY_WAIT_S = 2.0  # for discovery to show a frontend that queued a task
_task_decoder = msgspec.msgpack.Decoder(PrefillTask)
_encoder = msgspec.msgpack.Encoder()


class PrefillQueueConsumer:
    """Pulls ``model``'s prefill tasks for the engine behind ``adapter`` (instance
    ``worker_id``)."""

    def __init__(
        self, runtime: DistributedRuntime, adapter: EngineAdapter, worker_id: int, model: str
    ) -> None:
        self._runtime = runtime
        self._adapter = adapter
        self._worker_id = worker_id
        self._model = model
        self._queue: WorkQueue | None = None
        self._replies: EndpointClient | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self.tasks_done = 0

    async def start(self) -> None:
        self._queue = await self._runtime.work_queue(queue_name(self._model))
        endpoint = EndpointId(self._runtime.namespace, REPLY_COMPONENT, REPLY_ENDPOINT)
        self._replies = await self._runtime.client(endpoint)
        self._task = asyncio.create_task(self._consume(), name=f"prefill-queue:{self._model}")

    async def stop(self, grace_s: float) -> None:
        """Pull nothing more; give the task in hand ``grace_s`` seconds to finish."""
        self._stopping = True
        task = self._task
        if task is None:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(task), grace_s)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        self._task = None

    async def _consume(self) -> None:
        queue = self._queue
        assert queue is not None
        while not self._stopping:
            try:
                item = await queue.pull(PULL_SLICE_S)
            except DynamoError as exc:
                log.warning("prefill queue of %r: pull failed (%s)", self._model, exc)
                await asyncio.sleep(PULL_SLICE_S)
                continue
            if item is None:
                continue
            await self._run(queue, item)

    async def _run(self, queue: WorkQueue, item: WorkItem) -> None:
        try:
            task = _task_decoder.decode(item.payload)
        except msgspec.DecodeError as exc:
            log.error("dropping a malformed prefill task: %s", exc)
            await queue.ack(item)
            return
        ctx = Context(task.request.request_id)
        reply: PrefillReply
        try:
            terminal = None
            async for out in self._adapter.generate(task.request, ctx):
                if out.finish_reason is not None:
                    terminal = out
            reply = PrefillReply(task_id=task.task_id, worker_id=self._worker_id, output=terminal)
        except (EngineShutdown, WorkerShutdown) as exc:
            # This engine is going away: the task goes back for another worker (no error for
            # the request), and this consumer takes no more.
            log.info("prefill task %s given back: %s", task.task_id, exc)
            self._stopping = True
            await queue.nack(item)
            return
        except DynamoError as exc:
            reply = PrefillReply(
                task_id=task.task_id,
                worker_id=self._worker_id,
                error_kind=exc.kind,
                error=str(exc),
            )
        except asyncio.CancelledError:
            ctx.kill()  # cut short at shutdown: the engine frees it, the queue redelivers it
            raise
        await self._answer(task, reply)
        await queue.ack(item)
        self.tasks_done += 1

    async def _answer(self, task: PrefillTask, reply: PrefillReply) -> None:
        replies = self._replies
        assert replies is not None
        with contextlib.suppress(TimeoutError):  # a frontend this process has not seen yet
            async with asyncio.timeout(REPLY_WAIT_S):
                while task.reply_to not in replies.instance_ids():
                    await asyncio.sleep(0.05)
        try:
            async for _ in replies.stream(
                _encoder.encode(reply), Context(), instance_id=task.reply_to
            ):
                pass
        except DynamoError as exc:  # the frontend is gone: nobody waits for this prefill
            log.info("prefill reply for %s not delivered: %s", task.task_id, exc)
