"""The one owner of a generate request, from admission to :meth:`InflightRequest.finish`.

It holds the request's ids, its ``Context``, its timing and usage (``RunStats``), its formatter,
its admission ticket (``admission.py``) and the router loads its attempts added. ``finish()`` is
idempotent and the only place that records the request's metrics (``requests_total`` exactly
once, whatever the path: rejection, validation error, engine error before or after the first
token, disconnect, success), releases its admission ticket, frees its router load (each load
exactly once) and ends the request's root span (``http-request``, opened at arrival under the
client's W3C ``traceparent`` if it sent one).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from opentelemetry.trace import SpanKind, Status, StatusCode

from dynamo.frontend.admission import Ticket
from dynamo.frontend.attempt import Load
from dynamo.frontend.errors import to_http
from dynamo.frontend.exchange import Exchange
from dynamo.frontend.pipeline import ChoiceStats, RunStats
from dynamo.frontend.priority import PRIORITY_HEADER, STRICT_PRIORITY_HEADER
from dynamo.frontend.streaming import JSON_HEADERS, Formatter
from dynamo.observability import tracing
from dynamo.observability.meters import RequestMeters
from dynamo.observability.metrics import FrontendMetrics, observe_many
from dynamo.preprocess import Prepared
from dynamo.runtime.context import Context

log = logging.getLogger(__name__)


class InflightRequest:
    """One HTTP generate request. Labels (``model``, ``request_type``) are filled in as the
    request is parsed; :meth:`begin` marks the start of generation (gauges, context, stats)."""

    __slots__ = (
        "_metrics",
        "_namespace",
        "_on_finish",
        "endpoint",
        "model",
        "request_type",
        "request_id",
        "engine_id",
        "id_headers",
        "priority_headers",
        "started",
        "ctx",
        "stats",
        "fmt",
        "loads",
        "ticket",
        "finished",
        "span",
        "queued",
        "worker_type",
        "status",
        "meters",
    )

    def __init__(
        self,
        http: Exchange,
        metrics: FrontendMetrics,
        endpoint: str,
        *,
        namespace: str,
        on_finish: Callable[[InflightRequest], None] | None = None,
    ) -> None:
        self.started = time.monotonic()
        self._metrics = metrics
        self._namespace = namespace
        self._on_finish = on_finish
        self.endpoint = endpoint
        # Only served model names become metric labels: a client naming arbitrary models must
        # not grow the label set without bound ("unknown" until the model is found).
        self.model = "unknown"
        self.request_type = "unary"
        client_id = http.header("x-dynamo-request-id") or http.header("x-request-id")
        # 128 random bits in hex, as uuid4().hex but without building a UUID (a fifth of the
        # cost, on every request's path to its first token)
        self.request_id = client_id or os.urandom(16).hex()
        self.id_headers = [
            ("x-request-id", self.request_id),
            ("x-dynamo-request-id", self.request_id),
        ]
        # The id the engines, router and request plane see must be unique: a client may reuse
        # its x-request-id (retries), and a cancel by context id must not hit the other request.
        self.engine_id = (
            self.request_id if client_id is None else f"{client_id}-{os.urandom(6).hex()}"
        )
        # The router-queue priority headers, read by the preprocessing (frontend/priority.py).
        self.priority_headers = (
            http.header(PRIORITY_HEADER),
            http.header(STRICT_PRIORITY_HEADER),
        )
        self.ctx: Context | None = None
        self.stats: RunStats | None = None
        self.fmt: Formatter | None = None
        self.loads: list[Load] = []
        self.ticket: Ticket | None = None
        self.finished = False
        self.status = ""  # "success" or "error" once finished
        self.queued = False  # admitted, no response yet (the queued_requests gauge)
        self.worker_type = ""  # the serving role of the model (worker_* gauges)
        self.meters: RequestMeters | None = None  # the metric children, once labelled (begin)
        carrier = {k: v for k in ("traceparent", "tracestate") if (v := http.header(k))}
        self.span = tracing.tracer().start_span(
            "http-request",
            context=tracing.context_from_headers(carrier) if carrier else None,
            kind=SpanKind.SERVER,
            attributes={
                "http.method": "POST",
                "endpoint": endpoint,
                "request_id": self.request_id,
                "x_request_id": client_id or "",
            },
        )

    def begin(self, prepared: list[Prepared], n: int, fmt: Formatter) -> Context:
        """Generation starts: the request's context, stats and formatter; the gauges go up."""
        self.ctx = Context(self.engine_id)
        self.stats = RunStats(
            [ChoiceStats() for _ in prepared],
            prompt_tokens=sum(p.num_prompt_tokens for p in prepared) // n,
            started_at=self.started,
        )
        self.fmt = fmt
        meters = self.meters = self._metrics.meters.request(
            self.model, self.endpoint, self.request_type, self._namespace
        )
        meters.active.n += 1  # active_requests and inflight_requests
        meters.queued.n += 1
        meters.started.n += 1
        self.queued = True
        return self.ctx

    def first_response(self) -> None:
        """The first response came back: the request is no longer queued. Idempotent."""
        if self.queued:
            self.queued = False
            assert self.meters is not None  # queued only from begin()
            self.meters.queued.n -= 1

    def stop(self) -> None:
        """Ask the request to stop (shutdown, client gone): the engines abort."""
        if self.ctx is not None:
            self.ctx.stop_generating()

    # -- ends ----------------------------------------------------------------------------------
    def fail(self, http: Exchange, exc: BaseException, overload_status: int = 529) -> str:
        """Answer with the error's status and OpenAI body, and finish. Returns the error type."""
        reply = to_http(exc, overload_status)
        if reply.error_type == "overload":
            self._metrics.model_rejection.labels(self.model, self.endpoint).inc()
        http.reply(reply.status, [*JSON_HEADERS, *reply.headers, *self.id_headers], reply.body)
        self.finish("error", reply.error_type)
        return reply.error_type

    def disconnected(self) -> None:
        """The client went away mid-request: count it, and finish as cancelled."""
        self._metrics.disconnected_clients.inc()
        self._metrics.model_cancellation.labels(self.model, self.endpoint, self.request_type).inc()
        self.finish("error", "cancelled")

    def _per_worker(self, stats: RunStats) -> None:
        """The ``worker_last_*`` gauges of the workers that served the request's choices."""
        meters = self._metrics.meters
        for choice in stats.choices:
            sel = choice.selection
            if sel is None or choice.first_token_at is None:
                continue
            key = (f"{sel.instance_id:x}", str(sel.dp_rank or 0), self.worker_type)
            ttft, isl, itl = meters.worker_gauges(key)
            ttft.n = choice.first_token_at - self.started
            isl.n = float(stats.prompt_tokens)
            if choice.itls:
                itl.n = sum(choice.itls) / len(choice.itls)

    def finish(self, status: str = "success", error_type: str = "") -> None:
        """Record the outcome and free what the request holds. Idempotent: the first call wins."""
        if self.finished:
            return
        self.finished = True
        self.status = status
        if self.ticket is not None:
            self.ticket.release()
        for load in self.loads:
            load.free()
        m = self._metrics
        model = self.model
        meters = self.meters
        if status == "success" and not error_type and meters is not None:
            meters.succeeded.n += 1
        else:
            m.requests.labels(model, self.endpoint, self.request_type, status, error_type).inc()
        if status == "error":
            m.failures.labels(model, self.endpoint, self.request_type, error_type).inc()
        self.first_response()
        stats = self.stats
        if stats is not None:
            assert meters is not None  # both set by begin()
            meters.active.n -= 1
            meters.duration.observe(time.monotonic() - self.started)
            meters.input_tokens.observe(stats.prompt_tokens)
            meters.output_tokens.observe(stats.completion_tokens)
            meters.output_tokens_total.n += stats.completion_tokens
            first = stats.first_token_at
            if first is not None:
                meters.ttft.observe(first - self.started)
            for choice in stats.choices:
                observe_many(meters.itl, choice.itls)
            if stats.cached_tokens is not None:
                meters.cached_tokens.observe(stats.cached_tokens)
                if stats.prompt_tokens:
                    meters.kv_hit_rate.observe(stats.cached_tokens / stats.prompt_tokens)
            self._per_worker(stats)
        span = self.span
        # The handler's task has the request span current: this line carries its trace id.
        log.debug("request %s finished: %s %s", self.request_id, status, error_type or "-")
        if span.is_recording():  # a local span keeps no attributes: none are built for it
            attributes = {"model": model, "request_type": self.request_type, "status": status}
            if error_type:
                attributes["error_type"] = error_type
            span.set_attributes(attributes)
        if error_type and error_type != "cancelled":
            span.set_status(Status(StatusCode.ERROR, error_type))
        span.end()
        if self._on_finish is not None:
            self._on_finish(self)
