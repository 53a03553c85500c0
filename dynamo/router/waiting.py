"""The live router queue of one KV router: held requests as futures (FACTS §4.5).

The ordering is ``router/queue.py``'s :class:`PendingQueue` (shared with the offline replay);
this is its asyncio side for the frontend. :meth:`RouterQueue.hold` either lets a request
through at once (nothing held and a rank has capacity: the caller routes it as usual) or holds
it and returns a :class:`Waiter`. The owning :class:`~dynamo.router.kv_router.KVRouter` calls
:meth:`RouterQueue.drain` whenever capacity may have freed (a prefill completed, a request
ended, a worker joined or left, a replica's change); each released request is routed right
there (``select``: scored on the load of that moment, its own load counted before the next one
is considered) and its future resolved with the selection, or with the routing error.

:meth:`RouterQueue.wait` is the requester's side: it ends with the selection, or raises
``Cancelled`` (the request's context stopped: client gone), ``ResponseTimeout`` (held past the
first-response timeout), or the routing error. Whichever way it ends, the request leaves the
queue, and a selection it will not use has its load freed: a held request that goes away holds
nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from dynamo.protocol.model_card import ModelCard
from dynamo.protocol.request import PreprocessedRequest
from dynamo.router.basic import Selection
from dynamo.router.hashing import local_block_hashes
from dynamo.router.queue import Held, PendingQueue, QueuePolicy
from dynamo.runtime.context import Context
from dynamo.runtime.errors import Cancelled, DynamoError, ResponseTimeout

if TYPE_CHECKING:
    from dynamo.router.kv_router import KVRouter

Candidates = Callable[[], Sequence[ModelCard]]
"""The request's live candidates, asked again at release (workers come and go while it waits)."""


class Waiter:
    """One held request: what routes it at release and the future its requester awaits."""

    __slots__ = ("request", "candidates", "future", "held")

    def __init__(
        self,
        request: PreprocessedRequest,
        candidates: Candidates,
        future: asyncio.Future[Selection],
    ) -> None:
        self.request = request
        self.candidates = candidates
        self.future = future
        self.held: Held[Waiter] | None = None


class RouterQueue:
    """The held requests of one KV router. Driven by the frontend's loop only."""

    def __init__(self, router: KVRouter) -> None:
        settings = router.settings
        self._router = router
        self._core = router.core
        self.policy = QueuePolicy(settings.queue_policy)
        self.pending: PendingQueue[Waiter] = PendingQueue(self.policy, settings.queue_max_requests)
        self._draining = False

    def __len__(self) -> int:
        return len(self.pending)

    def hold(self, request: PreprocessedRequest, candidates: Candidates) -> Waiter | None:
        """None: route ``request`` now (nothing is held and an eligible rank has capacity).
        Otherwise the request is held (``QueueFull``, an ``Overloaded``, past the queue's
        limit) and the returned waiter's future resolves at its release."""
        if not len(self.pending) and not self._saturated(request, candidates):
            return None
        hints = request.routing
        isl = len(request.token_ids)
        cached = self._cached_tokens(request) if self.policy is QueuePolicy.WSPT else 0
        waiter = Waiter(request, candidates, asyncio.get_running_loop().create_future())
        waiter.held = self.pending.push(
            waiter,
            priority_jump=hints.priority_jump if hints is not None else 0.0,
            strict_priority=hints.strict_priority if hints is not None else 0,
            isl=isl,
            cached_tokens=cached,
        )
        self.drain()  # a head held on other workers' load may be behind ranks that are free
        return waiter

    def drain(self) -> int:
        """Route the front requests while their workers have capacity; returns how many.
        Not re-entered: a release that adds a worker (``select`` meets an unknown card) asks
        for a drain the running one already does."""
        if not len(self.pending) or self._draining:
            return 0
        self._draining = True
        try:
            return self.pending.drain(self._ready, self._release)
        finally:
            self._draining = False

    async def wait(self, waiter: Waiter, ctx: Context, timeout_s: float) -> Selection:
        """The held request's selection (its load counted), once released. Raises
        ``Cancelled`` when ``ctx`` stops first, ``ResponseTimeout`` after ``timeout_s`` (0: no
        limit), or the routing error. The request leaves the queue whichever way this ends."""
        future = waiter.future

        def on_stop(_: Context) -> None:
            if not future.done():
                future.cancel()

        remove = ctx.on_stop(on_stop)
        consumed = False
        try:
            try:
                if timeout_s > 0:
                    async with asyncio.timeout(timeout_s):
                        selection = await future
                else:
                    selection = await future
            except TimeoutError:
                raise ResponseTimeout(
                    f"the request waited {timeout_s:g}s in the router queue for capacity"
                ) from None
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if future.cancelled() and ctx.is_stopped() and task and not task.cancelling():
                    raise Cancelled("the request was cancelled while queued") from None
                raise
            consumed = True
            return selection
        finally:
            remove()
            self._abandon(waiter, consumed)

    # -- internals ---------------------------------------------------------------------------
    def _saturated(self, request: PreprocessedRequest, candidates: Candidates) -> bool:
        try:
            live = candidates()
        except DynamoError:
            return False  # routing raises it (no live instance)
        hints = request.routing
        return self._core.saturated(
            {card.instance_id for card in live},
            hints.backend_instance_id if hints is not None else None,
            hints.dp_rank if hints is not None else None,
        )

    def _ready(self, held: Held[Waiter]) -> bool:
        waiter = held.item
        return not self._saturated(waiter.request, waiter.candidates)

    def _release(self, held: Held[Waiter]) -> None:
        waiter = held.item
        if waiter.future.done():  # cancelled while held: the requester is already gone
            return
        try:
            selection = self._router.select(waiter.request, waiter.candidates())
        except DynamoError as exc:
            waiter.future.set_exception(exc)
            return
        waiter.future.set_result(selection)

    def _abandon(self, waiter: Waiter, consumed: bool) -> None:
        held = waiter.held
        if held is not None and self.pending.discard(held):
            waiter.future.cancel()
            self.drain()  # the front may have changed
            return
        future = waiter.future
        if consumed or not future.done() or future.cancelled():
            return
        if future.exception() is None:  # released, but the requester went away: free its load
            self._router.on_finish(waiter.request.request_id or "")

    def _cached_tokens(self, request: PreprocessedRequest) -> int:
        """The prompt tokens the best-placed rank holds already (wspt's key)."""
        core = self._core
        local = local_block_hashes(request.token_ids, core.block_size, lora_name=request.lora_name)
        overlaps = core.find_matches(local)
        best = max(overlaps.values(), default=0)
        return min(best * core.block_size, len(request.token_ids))
