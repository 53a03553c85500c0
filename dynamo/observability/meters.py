"""The frontend's per-request metric children, resolved once per label set instead of on every
request (issue 11: a request's fixed cost).

A request touches ~20 labelled children (counters, gauges, histograms). :class:`Meters` (one per
:class:`~dynamo.observability.metrics.FrontendMetrics`) keeps them resolved per model, endpoint,
request type and namespace (:class:`RequestMeters`), per stage (:class:`StageMeter`) and per
worker (``worker_gauges``), so a request looks them up once. The in-flight gauges
(``active_requests``, ``inflight_requests``, ``queued_requests``, ``stage_requests``) are
:class:`Level` s: a plain int the request path moves, which the gauge reads at scrape time
(``set_function``), instead of a locked ``inc``/``dec`` per request. What ``/metrics`` shows is
unchanged: the same names, labels and values.

Contract: a level is moved only on the event loop thread that serves the requests (the
frontend's one loop); a scrape from any thread reads it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dynamo.observability.metrics import FrontendMetrics


class Level:
    """The value of one gauge child as a plain int, read by the gauge at scrape time."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> float:
        return self.n

    @classmethod
    def of(cls, *children: Any) -> Level:
        """A level that ``children`` (gauge children, not shared with any ``inc``/``set``
        caller) report from now on."""
        level = cls()
        for child in children:
            child.set_function(level)
        return level


class StageMeter:
    """One pipeline stage's children: its in-flight level (``stage_requests``, by stage and
    phase) and its duration histogram (``stage_duration``, by stage)."""

    __slots__ = ("level", "duration")

    def __init__(self, level: Level, duration: Any) -> None:
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

    def __init__(
        self, m: FrontendMetrics, levels: tuple[Level, Level], key: tuple[str, str, str, str]
    ) -> None:
        model, endpoint, request_type, namespace = key
        self.active, self.queued = levels
        self.started = m.requests_started.labels(model, endpoint, request_type)
        self.succeeded = m.requests.labels(model, endpoint, request_type, "success", "")
        self.duration = m.request_duration.labels(model)
        self.input_tokens = m.input_tokens.labels(model, namespace)
        self.output_tokens = m.output_tokens.labels(model)
        self.output_tokens_total = m.output_tokens_total.labels(model, namespace)
        self.ttft = m.ttft.labels(model)
        self.itl = m.itl.labels(model)
        self.cached_tokens = m.cached_tokens.labels(model)
        self.kv_hit_rate = m.kv_hit_rate.labels(model)


class Meters:
    """The resolved children of one ``FrontendMetrics``, created on first use (a model's
    children appear in ``/metrics`` from its first request, as with ``labels()``)."""

    def __init__(self, metrics: FrontendMetrics) -> None:
        self._m = metrics
        self._levels: dict[str, tuple[Level, Level]] = {}
        self._requests: dict[tuple[str, str, str, str], RequestMeters] = {}
        self._stages: dict[tuple[str, str], StageMeter] = {}
        self._workers: dict[tuple[str, str, str], tuple[Any, Any, Any]] = {}

    def request(
        self, model: str, endpoint: str, request_type: str, namespace: str
    ) -> RequestMeters:
        key = (model, endpoint, request_type, namespace)
        meters = self._requests.get(key)
        if meters is None:
            levels = self._levels.get(model)
            if levels is None:
                m = self._m
                active = Level.of(
                    m.active_requests.labels(model), m.inflight_requests.labels(model)
                )
                levels = self._levels[model] = (active, Level.of(m.queued_requests.labels(model)))
            meters = self._requests[key] = RequestMeters(self._m, levels, key)
        return meters

    def stage(self, stage: str, phase: str = "") -> StageMeter:
        meter = self._stages.get((stage, phase))
        if meter is None:
            m = self._m
            level = Level.of(m.stage_requests.labels(stage, phase))
            meter = self._stages[stage, phase] = StageMeter(level, m.stage_duration.labels(stage))
        return meter

    def worker_gauges(self, key: tuple[str, str, str]) -> tuple[Any, Any, Any]:
        """The ``worker_last_{ttft,isl,itl}`` children of (worker id, dp rank, worker type)."""
        gauges = self._workers.get(key)
        if gauges is None:
            m = self._m
            gauges = self._workers[key] = (
                m.worker_last_ttft.labels(*key),
                m.worker_last_isl.labels(*key),
                m.worker_last_itl.labels(*key),
            )
        return gauges
