"""Disaggregated serving in the frontend: whether a prompt is prefilled on a prefill worker, and
running that remote prefill (spec 003, FACTS §9).

A model is disaggregated when it has decode workers. For each request the attempt loop
(``attempt.py``) first picks the decode worker (its router reports the prefix it already holds),
then asks :meth:`Disaggregation.prefill`:

* **decide** (conditional disaggregation): the prompt is prefilled remotely only when

  - rule ``prefill-length`` (spec 003, the default): the prefill length left after the decode
    worker's prefix hit exceeds ``max_local_prefill_length`` **and** the prefill queue holds
    fewer than ``max_prefill_queue_size`` requests;
  - rule ``isl-bounding`` (FACTS §9.1): not (effective ISL < ``eff_isl_threshold`` and
    effective ISL / ISL < ``eff_isl_ratio_threshold``), with the same queue bound.

  Both thresholds change at run time, without a restart, through the discovery key
  ``v1/disagg_router/{namespace}/{model}`` (JSON, :class:`DisaggOverrides`), which every
  frontend watches. A request that names its prefill worker (``x-prefill-instance-id`` /
  ``nvext.prefill_worker_id``) always goes remote. With no live prefill worker the decode worker
  prefills locally.
* **run**: a copy of the request with ``max_tokens=1`` goes to a prefill worker, whose terminal
  chunk carries the handoff (:class:`DisaggregatedParams`). Its token is never sent to the
  client: the decode worker resumes from the handoff and produces the first token again.

  - dispatch ``route`` (FACTS §9.1): the prefill set's own router picks the prefill worker;
  - dispatch ``queue`` (spec 003): the copy goes onto the model's global prefill queue and the
    first free prefill worker pulls it (``prefill_queue.py``); a request naming its prefill
    worker is still routed to it.

  Once dispatched, a failed prefill fails the attempt (no silent fallback to a local prefill);
  a failure of the prefill worker (it died, or its KV could not be fetched) is migratable: with
  migration on, the attempt loop starts again, without that prefill worker.

The "prefill queue" the rule bounds: in route mode, the remote prefills in flight beyond one per
live prefill worker (the ones waiting on a busy prefill worker); in queue mode, the tasks
waiting in the queue.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from dynamo.frontend.attempt import Load, Timeouts, held_route, placed, transport
from dynamo.frontend.migration import is_instance_fault
from dynamo.frontend.prefill_queue import PrefillQueueDispatch
from dynamo.observability.metrics import FrontendMetrics
from dynamo.protocol.disagg import DisaggregatedParams
from dynamo.protocol.model_card import ModelCard, WorkerRole
from dynamo.protocol.output import FinishReason, LLMEngineOutput
from dynamo.protocol.request import OutputOptions, PreprocessedRequest, RoutingHints, TraceLink
from dynamo.router.basic import Selection
from dynamo.runtime.config import add_flag
from dynamo.runtime.context import Context
from dynamo.runtime.discovery.base import Discovery
from dynamo.runtime.discovery.follower import PrefixFollower
from dynamo.runtime.errors import (
    Cancelled,
    DynamoError,
    NoInstances,
    StreamIncomplete,
    Unknown,
    from_kind,
)
from dynamo.runtime.naming import disagg_router_prefix
from dynamo.runtime.runtime import DistributedRuntime

if TYPE_CHECKING:
    from dynamo.frontend.model_registry import ModelEntry
    from dynamo.frontend.pipeline import ModelPipeline

log = logging.getLogger(__name__)

DISPATCH_MODES = ("route", "queue")
RULES = ("prefill-length", "isl-bounding")
_encoder = msgspec.msgpack.Encoder()


@dataclass(frozen=True, slots=True)
class DisaggSettings:
    """The frontend's disaggregation flags (defaults: the reference's, FACTS §9)."""

    dispatch: str = "route"
    max_local_prefill_length: int = 1000
    max_prefill_queue_size: int = 2
    rule: str = "prefill-length"
    eff_isl_threshold: int = 2048
    eff_isl_ratio_threshold: float = 0.7

    def __post_init__(self) -> None:
        if self.dispatch not in DISPATCH_MODES:
            raise ValueError(f"prefill dispatch must be one of {DISPATCH_MODES}")
        if self.rule not in RULES:
            raise ValueError(f"conditional disaggregation rule must be one of {RULES}")
        if self.max_local_prefill_length < 0 or self.max_prefill_queue_size < 0:
            raise ValueError("disaggregation thresholds must be >= 0")

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        d = DisaggSettings()
        g = parser.add_argument_group("disaggregation")
        add_flag(
            g,
            "--prefill-dispatch",
            default=d.dispatch,
            choices=DISPATCH_MODES,
            help="how remote prefills reach prefill workers (route: a KV router over them; "
            "queue: a global prefill queue per model that prefill workers pull from)",
        )
        add_flag(
            g,
            "--max-local-prefill-length",
            default=d.max_local_prefill_length,
            type=int,
            help="prefill remotely only when the prompt left after the decode worker's prefix "
            "hit is longer than this (changeable at run time through discovery)",
        )
        add_flag(
            g,
            "--max-prefill-queue-size",
            default=d.max_prefill_queue_size,
            type=int,
            help="prefill remotely only while fewer requests than this wait for a prefill worker "
            "(changeable at run time through discovery)",
        )
        add_flag(
            g,
            "--conditional-disagg-rule",
            default=d.rule,
            choices=RULES,
            help="prefill-length (spec 003) or isl-bounding (FACTS §9.1)",
        )
        add_flag(
            g,
            "--eff-isl-threshold",
            default=d.eff_isl_threshold,
            type=int,
            help="isl-bounding: local when the effective ISL is below this (and the ratio)",
        )
        add_flag(
            g,
            "--eff-isl-ratio-threshold",
            default=d.eff_isl_ratio_threshold,
            type=float,
            help="isl-bounding: local when effective ISL / ISL is below this (and the length)",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DisaggSettings:
        return cls(
            dispatch=args.prefill_dispatch,
            max_local_prefill_length=args.max_local_prefill_length,
            max_prefill_queue_size=args.max_prefill_queue_size,
            rule=args.conditional_disagg_rule,
            eff_isl_threshold=args.eff_isl_threshold,
            eff_isl_ratio_threshold=args.eff_isl_ratio_threshold,
        )


class DisaggOverrides(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """The run-time thresholds of one model, at ``v1/disagg_router/{namespace}/{model}`` (JSON);
    a field left out keeps the frontend's flag."""

    max_local_prefill_length: int | None = None
    max_prefill_queue_size: int | None = None


_overrides_decoder = msgspec.json.Decoder(DisaggOverrides)


async def set_overrides(
    discovery: Discovery, namespace: str, model: str, overrides: DisaggOverrides
) -> None:
    """Publish ``model``'s run-time thresholds (every frontend of the namespace applies them)."""
    await discovery.put(disagg_router_prefix(namespace) + model, msgspec.json.encode(overrides))


@dataclass(slots=True)
class _ModelState:
    inflight: int = 0
    overrides: DisaggOverrides = field(default_factory=DisaggOverrides)


def prefill_remotely(
    settings: DisaggSettings,
    isl: int,
    cached: int,
    queue_depth: int,
    max_local: int | None = None,
    max_queue: int | None = None,
) -> bool:
    """The conditional-disaggregation rule (module docstring), pure: a prompt of ``isl``
    tokens, ``cached`` of them on the chosen decode worker, with ``queue_depth`` remote
    prefills waiting. ``max_local``/``max_queue`` override the settings' thresholds (run-time
    overrides). Shared with the offline replay."""
    if max_local is None:
        max_local = settings.max_local_prefill_length
    if max_queue is None:
        max_queue = settings.max_prefill_queue_size
    if queue_depth >= max_queue:
        return False
    effective = max(0, isl - cached)
    if settings.rule == "isl-bounding":
        return not (
            effective < settings.eff_isl_threshold
            and isl > 0
            and effective / isl < settings.eff_isl_ratio_threshold
        )
    return effective > max_local


class Disaggregation:
    """One per frontend: the settings, the run-time overrides (watched in discovery) and the
    remote prefills in flight per model. Driven by the frontend's event loop only."""

    def __init__(
        self,
        settings: DisaggSettings,
        runtime: DistributedRuntime,
        metrics: FrontendMetrics | None = None,
    ) -> None:
        """``runtime`` may start later: its discovery is watched from :meth:`start`."""
        self.settings = settings
        self._runtime = runtime
        self._prefix = disagg_router_prefix(runtime.namespace)
        self._metrics = metrics
        self._models: dict[str, _ModelState] = {}
        self._follower: PrefixFollower | None = None
        self._queue = PrefillQueueDispatch(runtime) if settings.dispatch == "queue" else None

    # -- run-time thresholds ------------------------------------------------------------------
    async def start(self) -> None:
        if self._queue is not None:
            await self._queue.start()
        self._follower = PrefixFollower(
            self._runtime.discovery,
            self._prefix,
            self._apply,
            lambda key: self._apply(key, None),
            name="disagg-overrides-watch",
        )
        await self._follower.start()

    async def close(self) -> None:
        if self._follower is not None:
            await self._follower.close()
            self._follower = None
        if self._queue is not None:
            await self._queue.close()

    def _apply(self, key: str, value: bytes | None) -> None:
        model = key.removeprefix(self._prefix)
        state = self._state(model)
        if value is None:
            state.overrides = DisaggOverrides()
            log.info("disaggregation thresholds of %r back to the flags' values", model)
            return
        try:
            overrides = _overrides_decoder.decode(value)
        except msgspec.DecodeError as exc:
            log.warning("ignoring malformed disaggregation thresholds at %s: %s", key, exc)
            return
        for value_ in (overrides.max_local_prefill_length, overrides.max_prefill_queue_size):
            if value_ is not None and value_ < 0:
                log.warning("ignoring negative disaggregation thresholds at %s", key)
                return
        state.overrides = overrides
        log.info("disaggregation thresholds of %r: %s", model, overrides)

    def _state(self, model: str) -> _ModelState:
        state = self._models.get(model)
        if state is None:
            state = self._models[model] = _ModelState()
        return state

    def thresholds(self, model: str) -> tuple[int, int]:
        """``(max_local_prefill_length, max_prefill_queue_size)`` in force for ``model``."""
        o = self._state(model).overrides
        s = self.settings
        return (
            s.max_local_prefill_length
            if o.max_local_prefill_length is None
            else o.max_local_prefill_length,
            s.max_prefill_queue_size
            if o.max_prefill_queue_size is None
            else o.max_prefill_queue_size,
        )

    def queue_depth(self, model: str, num_prefill_workers: int) -> int:
        """Remote prefills waiting for a prefill worker (route mode: those beyond one per live
        prefill worker)."""
        return max(0, self._state(model).inflight - num_prefill_workers)

    # -- the decision -----------------------------------------------------------------------
    def remote(
        self,
        model: str,
        isl: int,
        cached: int,
        num_prefill_workers: int,
        queue_depth: int | None = None,
    ) -> bool:
        """Whether a prompt of ``isl`` tokens, ``cached`` of them on the chosen decode worker,
        is prefilled remotely (the module docstring gives the rules). ``queue_depth``: the
        prefill queue's waiting tasks (queue mode), else the route-mode estimate."""
        max_local, max_queue = self.thresholds(model)
        if queue_depth is None:
            queue_depth = self.queue_depth(model, num_prefill_workers)
        return prefill_remotely(self.settings, isl, cached, queue_depth, max_local, max_queue)

    # -- the remote prefill -------------------------------------------------------------------
    async def prefill(
        self,
        entry: ModelEntry[ModelPipeline],
        request: PreprocessedRequest,
        decode: Selection,
        ctx: Context,
        loads: list[Load],
        timeouts: Timeouts,
        *,
        on_link: Callable[[TraceLink], None] | None = None,
    ) -> DisaggregatedParams | None:
        """Run ``request``'s prefill on a prefill worker and return its handoff, or None when
        the decode worker ``decode`` prefills it locally. Raises DynamoError if the remote
        prefill fails (the request fails: no fallback once dispatched). ``on_link`` gets the
        prefill worker's ``engine.generate`` span (the decode request links to it)."""
        model = entry.name
        live = entry.live_instance_ids(WorkerRole.PREFILL)
        hints = request.routing
        forced = hints is not None and hints.prefill_worker_id is not None
        if forced and not live:
            raise NoInstances(f"{model!r} has no live prefill worker")
        queued = self._queue is not None and not forced
        if not forced:
            bs = entry.cards[decode.instance_id].kv_block_size
            cached = decode.overlap_blocks * bs
            depth = None
            if live and self._queue is not None:
                depth = await self._queue.waiting(model)
                if self._metrics is not None:
                    self._metrics.disagg_queue_depth.labels(model).set(depth)
            isl = len(request.token_ids)
            if not live or not self.remote(model, isl, cached, len(live), depth):
                self._count(model, "local")
                return None
        prefill_request = prefill_only(request)
        if queued:
            return await self._queued_prefill(entry, prefill_request, ctx, timeouts, on_link)
        router = entry.routers[WorkerRole.PREFILL]

        def prefill_candidates() -> list[ModelCard]:
            return [entry.cards[i] for i in entry.live_instance_ids(WorkerRole.PREFILL)]

        # Held until a prefill worker has capacity when the router has a queue.
        selection = await held_route(router, prefill_request, prefill_candidates, ctx, timeouts)
        load = Load(router, request.request_id or ctx.id)
        loads.append(load)
        self._count(model, "remote")
        state = self._state(model)
        state.inflight += 1
        self._gauges(model, len(live))
        try:
            body = _encoder.encode(placed(prefill_request, selection))
            client = entry.clients[WorkerRole.PREFILL]
            terminal: LLMEngineOutput | None = None
            try:
                async for outs in transport(client, body, ctx, selection.instance_id, timeouts):
                    for out in outs:
                        if out.worker_trace_link is not None and on_link is not None:
                            on_link(out.worker_trace_link)
                        if out.finish_reason is not None:
                            terminal = out
            except DynamoError as exc:
                if is_instance_fault(exc):  # out of routing at once (a retry avoids it)
                    entry.report_down(selection.instance_id)
                raise
            return handoff_of(terminal, selection.instance_id)
        finally:
            load.free()
            state.inflight -= 1
            self._gauges(model, len(entry.live_instance_ids(WorkerRole.PREFILL)))

    async def _queued_prefill(
        self,
        entry: ModelEntry[ModelPipeline],
        request: PreprocessedRequest,
        ctx: Context,
        timeouts: Timeouts,
        on_link: Callable[[TraceLink], None] | None,
    ) -> DisaggregatedParams:
        """Dispatch ``queue``: the prefill through the model's global prefill queue."""
        assert self._queue is not None
        model = entry.name
        self._count(model, "remote")
        state = self._state(model)
        state.inflight += 1
        self._gauges(model, 0)
        try:
            reply = await self._queue.prefill(
                model,
                request,
                ctx,
                timeouts.first_response_s,
                lambda: len(entry.live_instance_ids(WorkerRole.PREFILL)),
            )
        finally:
            state.inflight -= 1
            self._gauges(model, 0)
        if reply.error_kind is not None:
            exc = from_kind(reply.error_kind, reply.error or "")
            if is_instance_fault(exc):
                entry.report_down(reply.worker_id)
            raise exc
        out = reply.output
        if out is not None and out.worker_trace_link is not None and on_link is not None:
            on_link(out.worker_trace_link)
        return handoff_of(out, reply.worker_id)

    def _count(self, model: str, placement: str) -> None:
        if self._metrics is not None:
            self._metrics.disagg_prefills.labels(model, placement).inc()

    def _gauges(self, model: str, num_prefill_workers: int) -> None:
        m = self._metrics
        if m is not None:
            state = self._state(model)
            m.disagg_remote_inflight.labels(model).set(state.inflight)
            if self._queue is None:  # queue mode: the queue's own depth, read per decision
                depth = self.queue_depth(model, num_prefill_workers)
                m.disagg_queue_depth.labels(model).set(depth)


def handoff_of(terminal: LLMEngineOutput | None, worker_id: int) -> DisaggregatedParams:
    """The handoff in a prefill's terminal chunk; raises for a prefill that did not end with
    one (engine error: ``Unknown``; cancelled: ``Cancelled``; none: ``StreamIncomplete``)."""
    if terminal is None:
        raise StreamIncomplete(f"prefill worker {worker_id:x} ended without a terminal chunk")
    if terminal.finish_reason is FinishReason.ERROR:
        raise Unknown(f"remote prefill failed: {terminal.error or 'engine error'}")
    if terminal.finish_reason is FinishReason.CANCELLED:
        raise Cancelled("the prefill worker cancelled the request")
    if terminal.disaggregated_params is None:
        raise StreamIncomplete(f"prefill worker {worker_id:x} returned no KV handoff")
    return terminal.disaggregated_params


def prefill_only(request: PreprocessedRequest) -> PreprocessedRequest:
    """The request a prefill worker gets: the prompt and one token, nothing the client asked
    about the output (no log-probabilities), pinned where the client named a prefill worker."""
    stop = msgspec.structs.replace(request.stop, max_tokens=1, min_tokens=None)
    hints = request.routing
    routing = None
    if hints is not None and hints.prefill_worker_id is not None:
        routing = RoutingHints(
            backend_instance_id=hints.prefill_worker_id, dp_rank=hints.prefill_dp_rank
        )
    return msgspec.structs.replace(
        request, stop=stop, output=OutputOptions(), routing=routing, prefill_result=None
    )
