"""Attempts: route one engine request to one instance and stream its responses back.

An *attempt* is one try at serving one choice: the router's decision, a transport stream to that
instance, and the load the decision added to the router. It works on its own copy of the request
(the routing decision is written into a copy: the request is never mutated, so choices and later
attempts never see each other's placement). Its responses are bounded in time: the first within
``Timeouts.first_response_s``, each next within ``Timeouts.inter_chunk_s`` of asking for it, or
the attempt ends with :class:`ResponseTimeout`.

:func:`attempts` is the loop of attempts that serves one choice: instant failover (a failed
instance leaves routing) and request migration (``migration.py``) happen there.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import msgspec

from dynamo.frontend.idle import IdleTimer
from dynamo.frontend.migration import NO_MIGRATION, MigrationPolicy, is_instance_fault
from dynamo.frontend.pipeline import ChoiceStats
from dynamo.frontend.placement import InstanceStreams, continuation_candidates
from dynamo.observability import tracing
from dynamo.observability.metrics import FrontendMetrics
from dynamo.observability.router_metrics import RouterRequestSeries, kv_transfer_bound
from dynamo.protocol.model_card import ModelCard, WorkerRole
from dynamo.protocol.output import FinishReason, LLMEngineOutput
from dynamo.protocol.request import PreprocessedRequest, RoutingHints, TraceLink
from dynamo.router.basic import Router, Selection
from dynamo.runtime.client import EndpointClient
from dynamo.runtime.context import Context
from dynamo.runtime.errors import DynamoError, NoInstances, ResponseTimeout

if TYPE_CHECKING:
    from dynamo.frontend.model_registry import ModelEntry
    from dynamo.frontend.pipeline import ModelPipeline

_request_encoder = msgspec.msgpack.Encoder()
_OUTCOME = {
    FinishReason.STOP: "success",
    FinishReason.LENGTH: "success",
    FinishReason.CANCELLED: "cancelled",
}
_output_decoder = msgspec.msgpack.Decoder(LLMEngineOutput)


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Per-attempt response timeouts in seconds (0 disables one). Generous by default: a long
    prompt's prefill on a busy worker can take minutes; a silent worker must not hang a client
    forever."""

    first_response_s: float = 600.0
    inter_chunk_s: float = 300.0


class Load:
    """The load one routed request adds to its router, released exactly once: the prefill part at
    the first token, the whole at :meth:`free` (idempotent; the in-flight request frees whatever
    is left when it finishes). Once :meth:`dispatched`, the model's per-instance stream counts
    (``placement.InstanceStreams``) follow it too."""

    __slots__ = ("_router", "request_id", "prefilled", "freed", "_streams", "_instance", "_new")

    def __init__(self, router: Router, request_id: str) -> None:
        self._router = router
        self.request_id = request_id
        self.prefilled = False
        self.freed = False
        self._streams: InstanceStreams | None = None
        self._instance = 0
        self._new = False

    def dispatched(self, streams: InstanceStreams, instance_id: int, new_request: bool) -> None:
        """Sent to ``instance_id``; ``new_request``: a first attempt (not a continuation)."""
        if not self.freed and self._streams is None:
            self._streams, self._instance, self._new = streams, instance_id, new_request
            streams.dispatched(instance_id, new_request)

    def first_token(self) -> None:
        if not self.prefilled and not self.freed:
            self.prefilled = True
            self._router.on_first_token(self.request_id)
            if self._streams is not None and self._new:
                self._streams.first_token(self._instance)

    def free(self) -> None:
        if not self.freed:
            self.freed = True
            self._router.on_finish(self.request_id)
            if self._streams is not None:
                self._streams.ended(self._instance, self._new and not self.prefilled)


def candidates(entry: ModelEntry[ModelPipeline]) -> list[ModelCard]:
    """The model's serving workers that are live (a card and an endpoint registration)."""
    role = entry.serving_role()
    live = entry.live_instance_ids(role)
    if not live:
        raise NoInstances(f"Model temporarily unavailable: {entry.name!r} has no live instance")
    return [entry.cards[i] for i in live]


def placed(request: PreprocessedRequest, selection: Selection) -> PreprocessedRequest:
    """The request as sent to ``selection``: a copy carrying the chosen DP rank."""
    if selection.dp_rank is None:
        return request
    hints = request.routing
    if hints is not None and hints.dp_rank == selection.dp_rank:
        return request
    new_hints = (
        RoutingHints(dp_rank=selection.dp_rank)
        if hints is None
        else msgspec.structs.replace(hints, dp_rank=selection.dp_rank)
    )
    return msgspec.structs.replace(request, routing=new_hints)


ROUTER_MODES = {
    "KVRouter": "kv",
    "RoundRobinRouter": "round-robin",
    "RandomRouter": "random",
}


def route(
    router: Router,
    request: PreprocessedRequest,
    live: Sequence[ModelCard],
    metrics: FrontendMetrics | None = None,
) -> Selection:
    """``router.select`` inside the request's ``route`` span (router mode, chosen worker, DP
    rank, overlap blocks, cost) and ``route`` stage metrics."""
    with (
        metrics.stage("route") if metrics is not None else nullcontext(),
        tracing.tracer().start_as_current_span("route") as span,
    ):
        selection = router.select(request, live)
        if span.is_recording():  # a local span keeps no attributes: none are built for it
            mode = ROUTER_MODES.get(type(router).__name__, type(router).__name__)
            span.set_attributes(_described(selection, router_mode=mode, candidates=len(live)))
    return selection


async def held_route(
    router: Router,
    request: PreprocessedRequest,
    live: Callable[[], list[ModelCard]],
    ctx: Context,
    timeouts: Timeouts,
    metrics: FrontendMetrics | None = None,
) -> Selection:
    """:func:`route` among ``live()``, through the router's queue when it has one (FACTS §4.5):
    at once when a worker has capacity, else held (the ``route`` span and stage cover the wait)
    until capacity frees and routed then. A request held past ``timeouts.first_response_s``
    fails with ``ResponseTimeout``; one whose context stops while held, with ``Cancelled``; a
    full queue refuses it (``QueueFull``, 529)."""
    queue = router.queue
    waiter = queue.hold(request, live) if queue is not None else None
    if queue is None or waiter is None:
        return route(router, request, live(), metrics)
    with (
        metrics.stage("route") if metrics is not None else nullcontext(),
        tracing.tracer().start_as_current_span(
            "route", attributes={"router_mode": "kv", "queued": True}
        ) as span,
    ):
        began = time.monotonic()
        try:
            selection = await queue.wait(waiter, ctx, timeouts.first_response_s)
        finally:
            span.set_attribute("queue_wait_ms", (time.monotonic() - began) * 1000.0)
        span.set_attributes(_described(selection))
    return selection


def _described(selection: Selection, **attributes: str | int) -> dict[str, str | int | float]:
    """``attributes`` and the ``route`` span's description of ``selection`` (worker, DP rank,
    overlap blocks, cost): one ``set_attributes`` call."""
    out: dict[str, str | int | float] = {
        **attributes,
        "worker_id": f"{selection.instance_id:x}",
        "overlap_blocks": selection.overlap_blocks,
    }
    if selection.dp_rank is not None:
        out["dp_rank"] = selection.dp_rank
    if selection.cost is not None:
        out["cost"] = selection.cost
    return out


async def attempts(
    entry: ModelEntry[ModelPipeline],
    request: PreprocessedRequest,
    ctx: Context,
    stats: ChoiceStats,
    loads: list[Load],
    timeouts: Timeouts,
    policy: MigrationPolicy = NO_MIGRATION,
) -> AsyncGenerator[list[LLMEngineOutput], None]:
    """Serve one choice: yield its engine outputs, a batch (every chunk already received) at a
    time; the terminal chunk, when it comes, is the last one. Raises DynamoError on failure.

    The loop of attempts: an attempt that fails in a way that implicates its instance takes the
    instance out of routing at once (``ModelEntry.report_down``, whatever the migration
    policy); a migratable failure (``migration.py``) while the budget allows starts another
    attempt, on another instance when there is one, continuing where the stream stopped. Every
    load an attempt adds is appended to ``loads`` (and freed when the attempt ends).

    A disaggregated model (decode workers) first has its prompt prefilled on a prefill worker
    when ``frontend/disagg.py`` decides so; the decode worker then resumes from the handoff. A
    failure before the decode worker was sent the request (the remote prefill) does not take
    the decode instance out of routing.
    """
    migration = policy.start(entry.name, request, entry.migration_limit)
    began = time.monotonic()
    failure: DynamoError | None = None
    avoid: int | None = None
    outcome = "cancelled"
    try:
        while True:
            current = migration.request
            if failure is not None:  # a retry: its engine.generate span links to the last
                current = tracing.with_predecessor(current, stats.trace_link)
            try:
                metrics = entry.pipeline.metrics if entry.pipeline is not None else None
                live = partial(_live, entry, avoid, current, failure is not None)
                selection = await held_route(entry.router, current, live, ctx, timeouts, metrics)
            except DynamoError:
                if failure is not None:  # nowhere left to migrate to: the failure stands
                    outcome = "failure"
                    raise failure from None
                raise
            received = False
            dispatched: list[bool] = []
            attempt = _attempt(
                entry, current, selection, ctx, stats, loads, timeouts, dispatched, failure is None
            )
            try:
                async for outs in attempt:
                    received = True
                    migration.record(outs)
                    reason = outs[-1].finish_reason  # a terminal is always the last chunk
                    if reason is not None:
                        outcome = _OUTCOME.get(reason, "failure")
                    yield outs
                outcome = "success"
                return
            except DynamoError as exc:
                if dispatched and is_instance_fault(exc):
                    entry.report_down(selection.instance_id)
                if not migration.retry(exc, ctx, received):
                    outcome = "cancelled" if ctx.is_stopped() else "failure"
                    raise
                if migration.remaining_max_tokens == 0:
                    # Every token arrived; only the terminal was lost.
                    yield [LLMEngineOutput(token_ids=[], finish_reason=FinishReason.LENGTH)]
                    outcome = "success"
                    return
                failure = exc
                avoid = selection.instance_id
            finally:
                # Closed here, not left to the garbage collector: when our consumer stops
                # early the attempt's stream and load must go now.
                await attempt.aclose()
    finally:
        migration.finish(outcome)
        series = entry.router.series
        if series is not None and stats.selection is not None:  # routed by a KV router
            _observe_ended(series, stats, began)


def _observe_ended(series: RouterRequestSeries, stats: ChoiceStats, began: float) -> None:
    first, last, tokens = stats.first_token_at, stats.last_token_at, stats.completion_tokens
    ttft = first - began if first is not None else None
    itl = (last - first) / (tokens - 1) if first is not None and last and tokens > 1 else None
    transfer = kv_transfer_bound(stats.prefill_done_at, first)
    series.ended(ttft, itl, tokens, stats.cached_tokens, transfer)


def _live(
    entry: ModelEntry[ModelPipeline],
    avoid: int | None,
    request: PreprocessedRequest,
    continuation: bool,
) -> list[ModelCard]:
    """The candidates of an attempt: the live serving workers, less the instance the last
    attempt failed on when another is live; a continuation (migration) goes where it starts
    soonest (``placement.continuation_candidates``)."""
    live = candidates(entry)
    if avoid is not None and len(live) > 1:
        live = [c for c in live if c.instance_id != avoid] or live
    if continuation:
        live = continuation_candidates(entry.router, request, live, entry.streams)
    return live


async def _attempt(
    entry: ModelEntry[ModelPipeline],
    request: PreprocessedRequest,
    selection: Selection,
    ctx: Context,
    stats: ChoiceStats,
    loads: list[Load],
    timeouts: Timeouts,
    dispatched: list[bool],
    new_request: bool = True,
) -> AsyncGenerator[list[LLMEngineOutput], None]:
    """One attempt: stream ``request`` to the routed ``selection``, bounded by ``timeouts``
    (after a remote prefill for a disaggregated model). ``dispatched`` gets an entry once the
    request is sent to the selected instance; ``new_request``: a first attempt, not a
    continuation (``placement.py`` counts its pending prefill)."""
    router = entry.router
    role = entry.serving_role()
    metrics = entry.pipeline.metrics if entry.pipeline is not None else None
    request = tracing.with_traceparent(request)  # the worker's spans join this trace
    stats.selection = selection
    load = Load(router, request.request_id or ctx.id)
    loads.append(load)
    try:
        pipeline = entry.pipeline
        disagg = pipeline.disagg if pipeline is not None else None
        if role is WorkerRole.DECODE and disagg is not None:
            prefill_links: list[TraceLink] = []
            handoff = await disagg.prefill(
                entry, request, selection, ctx, loads, timeouts, on_link=prefill_links.append
            )
            if handoff is not None:
                if stats.first_token_at is None:  # a continuation's prefill bounds nothing
                    stats.prefill_done_at = time.monotonic()
                request = msgspec.structs.replace(request, prefill_result=handoff)
                # The decode worker's engine.generate span links to the prefill's.
                link = prefill_links[-1] if prefill_links else None
                request = tracing.with_predecessor(request, link)
        stats.dispatched_at = time.monotonic()
        body = _request_encoder.encode(placed(request, selection))
        dispatched.append(True)
        load.dispatched(entry.streams, selection.instance_id, new_request)
        dispatch = _DispatchStage(metrics, role.value)
        outputs = transport(entry.clients[role], body, ctx, selection.instance_id, timeouts)
        try:
            async for outs in outputs:
                dispatch.done()
                if not load.prefilled and any(o.token_ids for o in outs):
                    load.first_token()
                    for o in outs:
                        if o.worker_trace_link is not None:
                            stats.trace_link = o.worker_trace_link
                yield outs
        finally:
            dispatch.done()
            # Closed here: our consumer stops at the terminal chunk, so the transport is still
            # suspended at its last yield. Left to the garbage collector, the loop's finalizer
            # hook would close it in a task of its own, scheduled with ``call_soon_threadsafe``
            # (an eventfd write, an extra loop wake-up and a task, on every request), and its
            # stream and watchdog would outlive the attempt by a loop iteration.
            await outputs.aclose()
    finally:
        load.free()


async def transport(
    client: EndpointClient,
    body: bytes,
    ctx: Context,
    instance_id: int,
    timeouts: Timeouts,
) -> AsyncGenerator[list[LLMEngineOutput], None]:
    """One request-plane stream to ``instance_id``, decoded, in batches, under ``timeouts``
    (:class:`ResponseTimeout` when the worker stays silent too long). Ends after the terminal."""
    stream = client.stream_batches(body, ctx, instance_id=instance_id)
    receive = stream.__anext__
    decode = _output_decoder.decode
    watchdog: IdleTimer | None = None
    expired = False
    task = asyncio.current_task()
    assert task is not None
    if timeouts.first_response_s > 0:

        def on_idle() -> None:
            nonlocal expired
            expired = True
            task.cancel()

        watchdog = IdleTimer(timeouts.first_response_s, on_idle)
    first = True
    try:
        while True:
            if watchdog is not None:
                watchdog.touch()
            try:
                raw = await receive()
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if expired and task.uncancel() == 0:
                    phase = "first response" if first else "next response"
                    limit = timeouts.first_response_s if first else timeouts.inter_chunk_s
                    raise ResponseTimeout(
                        f"worker {instance_id:x} sent no {phase} within {limit:g}s"
                    ) from None
                raise
            if watchdog is not None:
                watchdog.pause()
            outs = [decode(b) for b in raw] if len(raw) > 1 else [decode(raw[0])]
            if first:
                first = False
                if watchdog is not None:
                    if timeouts.inter_chunk_s > 0:
                        watchdog.set_period(timeouts.inter_chunk_s)
                    else:
                        watchdog.cancel()
                        watchdog = None
            yield outs
    finally:
        if watchdog is not None:
            watchdog.cancel()
        await stream.aclose()


_PHASES = {"agg": "aggregated", "prefill": "prefill", "decode": "decode"}


class _DispatchStage:
    """The ``dispatch`` stage of one attempt: sent, until its first response (or its end)."""

    __slots__ = ("_meter", "_started")

    def __init__(self, metrics: FrontendMetrics | None, role: str) -> None:
        self._meter = (
            None if metrics is None else metrics.meters.stage("dispatch", _PHASES.get(role, role))
        )
        self._started: float | None = None
        if self._meter is not None:
            self._meter.level.n += 1
            self._started = time.perf_counter()

    def done(self) -> None:
        if self._meter is not None and self._started is not None:
            self._meter.level.n -= 1
            self._meter.duration.observe(time.perf_counter() - self._started)
            self._started = None
