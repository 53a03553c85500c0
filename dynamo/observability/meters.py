"""The frontend's per-request metric children, resolved once per label set instead of on every
request (issue 11: a request's fixed cost).

A request touches ~20 labelled children (counters, gauges, histograms). :class:`Meters` (one per
:class:`~dynamo.observability.metrics.FrontendMetrics`) keeps them resolved per model, endpoint,
request type and namespace (:class:`RequestMeters`), per stage (:class:`StageMeter`) and per
worker (``worker_gauges``), so a request looks them up once. Their values are
:class:`Tally` s (a histogram's through :class:`HistogramTally`): plain numbers the request
path moves (``tally.n += 1``) in place of prometheus_client's locked value objects, whose every
update is a few calls and a lock (a request made ~30: ~6 % of the frontend's instructions a
request, docs/performance.md, helper fe64b). The scrape reads them through the library's own
exposition. What ``/metrics`` shows is unchanged: the same names, labels and values.

Contract: the children handed out here are updated only on the event loop thread that serves
the requests (the frontend's one loop; nothing else holds them); a scrape from any thread reads
them. The frontend's registry is its own, never prometheus_client's multiprocess mode.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dynamo.observability.metrics import FrontendMetrics


class Tally:
    """A metric child's value as a plain number: prometheus_client's value interface (``inc``,
    ``set``, ``get``, exemplars) without its lock, and ``n`` to move it without a call."""

    __slots__ = ("n", "_exemplar")

    def __init__(self, n: float = 0.0) -> None:
        self.n = n
        self._exemplar: Any = None

    def inc(self, amount: float) -> None:
        self.n += amount

    def set(self, value: float, timestamp: float | None = None) -> None:
        self.n = value

    def get(self) -> float:
        return self.n

    def set_exemplar(self, exemplar: Any) -> None:
        self._exemplar = exemplar

    def get_exemplar(self) -> Any:
        return self._exemplar

    @classmethod
    def of(cls, *children: Any) -> Tally:
        """One tally that ``children`` (counter or gauge children) report from now on, starting
        from the first one's value (several: gauges that always move together); a child's own
        tally if it has one already (a child may serve several label sets of ours)."""
        value = children[0]._value
        if isinstance(value, Tally):
            return value
        tally = cls(value.get())
        for child in children:
            child._value = tally
        return tally


class HistogramTally:
    """A histogram child's sum and buckets as tallies; :meth:`observe` is the library's (the
    first bucket whose bound is ``>= amount``; a NaN counts in the sum and in no bucket)."""

    __slots__ = ("_bounds", "_buckets", "_sum")

    def __init__(self, child: Any) -> None:
        self._bounds = child._upper_bounds
        child._buckets = self._buckets = [Tally(b.get()) for b in child._buckets]
        child._sum = self._sum = Tally(child._sum.get())

    @classmethod
    def of(cls, child: Any) -> HistogramTally:
        """The tallies of a histogram child (made on first use, then the same)."""
        tally: HistogramTally | None = child.__dict__.get("_tally")
        if tally is None:
            tally = child._tally = cls(child)
        return tally

    def observe(self, amount: float) -> None:
        self._sum.n += amount
        if amount == amount:
            self._buckets[bisect_left(self._bounds, amount)].n += 1


class StageMeter:
    """One pipeline stage's children: its in-flight level (``stage_requests``, by stage and
    phase) and its duration histogram (``stage_duration``, by stage)."""

    __slots__ = ("level", "duration")

    def __init__(self, level: Tally, duration: HistogramTally) -> None:
        self.level = level
        self.duration = duration

    def timer(self) -> StageTimer:
        return StageTimer(self)


class StageTimer:
    """``with``: count a request in the stage and time it (a plain class: every request goes
    through several stages, and ``@contextmanager`` costs a generator per use)."""

    __slots__ = ("_meter", "_started")

    def __init__(self, meter: StageMeter) -> None:
        self._meter = meter
        self._started = 0.0

    def __enter__(self) -> None:
        self._meter.level.n += 1
        self._started = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self._meter.level.n -= 1
        self._meter.duration.observe(time.perf_counter() - self._started)


class RequestMeters:
    """The children a generate request of one model, endpoint, request type and namespace
    records into (``InflightRequest``): its levels (shared by every endpoint of the model),
    ``requests_started``, ``requests`` on success, and the histograms of its finish."""

    __slots__ = (
        "active",
        "queued",
        "started",
        "succeeded",
        "duration",
        "input_tokens",
        "output_tokens",
        "output_tokens_total",
        "ttft",
        "itl",
        "cached_tokens",
        "kv_hit_rate",
    )

    def __init__(self, m: FrontendMetrics, model: ModelMeters, key: tuple[str, ...]) -> None:
        name, endpoint, request_type, namespace = key
        self.active, self.queued = model.active, model.queued
        self.duration, self.output_tokens, self.ttft = (
            model.duration,
            model.output_tokens,
            model.ttft,
        )
        self.itl, self.cached_tokens, self.kv_hit_rate = (
            model.itl,
            model.cached_tokens,
            model.kv_hit_rate,
        )
        self.started = Tally.of(m.requests_started.labels(name, endpoint, request_type))
        self.succeeded = Tally.of(m.requests.labels(name, endpoint, request_type, "success", ""))
        self.input_tokens = HistogramTally.of(m.input_tokens.labels(name, namespace))
        self.output_tokens_total = Tally.of(m.output_tokens_total.labels(name, namespace))


class ModelMeters:
    """The children labelled by the model alone (shared by its endpoints and request types)."""

    __slots__ = (
        "active",
        "queued",
        "duration",
        "output_tokens",
        "ttft",
        "itl",
        "cached_tokens",
        "kv_hit_rate",
        "tokenizer_latency",
    )

    def __init__(self, m: FrontendMetrics, model: str) -> None:
        # active_requests and inflight_requests (its deprecated name) always move together
        self.active = Tally.of(m.active_requests.labels(model), m.inflight_requests.labels(model))
        self.queued = Tally.of(m.queued_requests.labels(model))
        self.duration = HistogramTally.of(m.request_duration.labels(model))
        self.output_tokens = HistogramTally.of(m.output_tokens.labels(model))
        self.ttft = HistogramTally.of(m.ttft.labels(model))
        self.itl = m.itl.labels(model)  # observe_many: a request's inter-token latencies at once
        HistogramTally.of(self.itl)
        self.cached_tokens = HistogramTally.of(m.cached_tokens.labels(model))
        self.kv_hit_rate = HistogramTally.of(m.kv_hit_rate.labels(model))
        self.tokenizer_latency = HistogramTally.of(m.tokenizer_latency.labels(model))


class Meters:
    """The resolved children of one ``FrontendMetrics``, created on first use (a model's
    children appear in ``/metrics`` from its first request, as with ``labels()``)."""

    def __init__(self, metrics: FrontendMetrics) -> None:
        self._m = metrics
        self._models: dict[str, ModelMeters] = {}
        self._requests: dict[tuple[str, str, str, str], RequestMeters] = {}
        self._stages: dict[tuple[str, str], StageMeter] = {}
        self._workers: dict[tuple[str, str, str], tuple[Tally, Tally, Tally]] = {}

    def request(
        self, model: str, endpoint: str, request_type: str, namespace: str
    ) -> RequestMeters:
        key = (model, endpoint, request_type, namespace)
        meters = self._requests.get(key)
        if meters is None:
            meters = self._requests[key] = RequestMeters(self._m, self.model(model), key)
        return meters

    def model(self, model: str) -> ModelMeters:
        meters = self._models.get(model)
        if meters is None:
            meters = self._models[model] = ModelMeters(self._m, model)
        return meters

    def stage(self, stage: str, phase: str = "") -> StageMeter:
        meter = self._stages.get((stage, phase))
        if meter is None:
            m = self._m
            duration = HistogramTally.of(m.stage_duration.labels(stage))
            level = Tally.of(m.stage_requests.labels(stage, phase))
            meter = self._stages[stage, phase] = StageMeter(level, duration)
        return meter

    def worker_gauges(self, key: tuple[str, str, str]) -> tuple[Tally, Tally, Tally]:
        """The ``worker_last_{ttft,isl,itl}`` children of (worker id, dp rank, worker type)."""
        gauges = self._workers.get(key)
        if gauges is None:
            m = self._m
            gauges = self._workers[key] = (
                Tally.of(m.worker_last_ttft.labels(*key)),
                Tally.of(m.worker_last_isl.labels(*key)),
                Tally.of(m.worker_last_itl.labels(*key)),
            )
        return gauges
