"""``EngineAdapter``: runs ``engine.generate`` for the request plane.

Per request it (1) decodes the ``PreprocessedRequest``, (2) arms a cancellation monitor that calls
``engine.abort(ctx)`` when the context is stopped or killed, (3) validates the stream's terminal
rules, (4) turns unexpected exceptions into ``Unknown`` (typed ``DynamoError``s pass through so
they reach the client with their type) and (5) encodes each chunk.

Tracing: ``handle`` opens the worker's ``handle_payload`` span under the trace context the request
carries (``PreprocessedRequest.traceparent``) and ``generate`` the ``engine.generate`` span
under it, with the attributes of spec 000's table (model, input_tokens, disagg_role at entry;
ttft_ms at the first chunk with tokens; output_tokens, finish_reason, cancelled and the ITL
statistics at the terminal; error_kind and an error status on failures; a link to the
predecessor attempt, if any). Inter-token latencies and the ``worker_trace_link`` stamp are
per-chunk work, done only while spans are recorded somewhere (``tracing.recording()``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import cast

import msgspec
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from dynamo.backend.engine import LLMEngine
from dynamo.backend.validate import StreamValidator
from dynamo.observability import tracing
from dynamo.observability.metrics import WorkerMetrics
from dynamo.protocol.output import FinishReason, LLMEngineOutput
from dynamo.protocol.request import PreprocessedRequest
from dynamo.runtime.context import Context
from dynamo.runtime.errors import DynamoError, InvalidArgument, Unknown

log = logging.getLogger(__name__)

request_decoder = msgspec.msgpack.Decoder(PreprocessedRequest)
output_encoder = msgspec.msgpack.Encoder()
_encode = output_encoder.encode


class EngineAdapter:
    """Bridges an :class:`LLMEngine` to a request-plane handler. Owns the abort tasks."""

    def __init__(
        self,
        engine: LLMEngine,
        *,
        strict: bool = False,
        metrics: WorkerMetrics | None = None,
        disagg_role: str = "agg",
    ) -> None:
        """``strict``: raise on stream-contract violations instead of repairing them.
        ``disagg_role``: the worker's role (``agg``,
        ``prefill``, ``decode``), recorded on every ``engine.generate`` span."""
        self.engine = engine
        self.disagg_role = disagg_role
        self.strict = strict
        self.metrics = metrics
        self._abort_tasks: set[asyncio.Task[None]] = set()
        self.num_inflight = 0
        self.last_activity = time.monotonic()  # the latest output sent (health-check canaries)

    def handle(self, body: bytes, ctx: Context) -> AsyncIterator[bytes]:
        """The request-plane handler: bytes in, encoded ``LLMEngineOutput`` chunks out.

        Raises ``InvalidArgument`` at once for a malformed body. The stream is ``generate``'s
        own generator, encoding as it goes: a frame passes one async generator here, not two
        (each layer costs a resumption and an exception object a frame)."""
        try:
            request = request_decoder.decode(body)
        except msgspec.DecodeError as exc:
            raise InvalidArgument(f"malformed request: {exc}") from exc
        span = tracing.start_child(
            "handle_payload",
            tracing.remote_parent(request.traceparent),
            kind=SpanKind.SERVER,
            attributes={"request_id": request.request_id or ctx.id, "model": request.model},
        )
        stream = self._stream(request, ctx, span, _Payload(span, len(body)))
        return cast(AsyncIterator[bytes], stream)  # with a payload it yields bytes only

    def generate(
        self, request: PreprocessedRequest, ctx: Context, parent: Span | None = None
    ) -> AsyncIterator[LLMEngineOutput]:
        """Run one request through the engine with monitoring, validation and its
        ``engine.generate`` span (a child of ``parent``, else of the request's trace context)."""
        stream = self._stream(request, ctx, parent, None)
        return cast(AsyncIterator[LLMEngineOutput], stream)  # no payload: outputs only

    async def _stream(
        self,
        request: PreprocessedRequest,
        ctx: Context,
        parent: Span | None,
        payload: _Payload | None,
    ) -> AsyncIterator[LLMEngineOutput | bytes]:
        """``generate``'s stream; with ``payload`` (``handle``) its outputs encoded, the payload
        span's status and end, and the bytes in and out counted."""
        span = self._generate_span(request, parent)
        trace = _GenerateTrace(span, tracing.recording())
        remove_monitor = ctx.on_stop(self._schedule_abort)
        validator = StreamValidator(request.request_id or ctx.id, strict=self.strict)
        self.num_inflight += 1
        metrics = self.metrics
        started = time.monotonic()
        if metrics is not None:
            metrics.inflight.inc()
        try:
            stream = self.engine.generate(request, ctx)
            try:
                async for output in stream:
                    if validator.accept(output):
                        if output.finish_reason is not FinishReason.ERROR:
                            self.last_activity = time.monotonic()
                        trace.chunk(output)
                        if payload is None:
                            yield output
                        else:
                            chunk = _encode(output)
                            payload.sent += len(chunk)
                            yield chunk
            except DynamoError as exc:
                validator.terminated = True
                trace.error(exc.kind, str(exc))
                if metrics is not None:
                    metrics.error(exc.kind)
                raise
            except Exception as exc:
                with tracing.use(span):  # the log line carries the request's trace id
                    log.exception("engine error in request %s", ctx.id)
                trace.error("Unknown", f"{type(exc).__name__}: {exc}")
                if metrics is not None:
                    metrics.error("Unknown")
                raise Unknown(f"{type(exc).__name__}: {exc}") from exc
            repair = validator.finish()
            if repair is not None:
                trace.chunk(repair)
                if payload is None:
                    yield repair
                else:
                    chunk = _encode(repair)
                    payload.sent += len(chunk)
                    yield chunk
        except DynamoError as exc:
            if payload is not None:
                payload.span.set_status(Status(StatusCode.ERROR, f"{exc.kind}: {exc}"))
            raise
        finally:
            trace.end(ctx.is_stopped())
            self.num_inflight -= 1
            remove_monitor()
            if metrics is not None:
                metrics.inflight.dec()
                metrics.requests.inc()
                metrics.duration.observe(time.monotonic() - started)
                if ctx.is_stopped():
                    metrics.cancellations.inc()
            if payload is not None:
                payload.span.end()
                if metrics is not None:
                    metrics.request_bytes.inc(payload.received)
                    metrics.response_bytes.inc(payload.sent)

    def _generate_span(self, request: PreprocessedRequest, parent: Span | None) -> Span:
        span = tracing.start_child(
            "engine.generate",
            tracing.context_of(parent)
            if parent is not None
            else tracing.remote_parent(request.traceparent),
            links=tracing.links_of(request),
            attributes={
                "model": request.model,
                "input_tokens": len(request.token_ids),
                "disagg_role": self.disagg_role,
            },
        )
        link = request.migration_link
        if link is not None:
            span.set_attribute("migration_trace_id", link.trace_id)
            span.set_attribute("migration_span_id", link.span_id)
        return span

    def _schedule_abort(self, ctx: Context) -> None:
        task = asyncio.get_running_loop().create_task(
            self._abort(ctx), name=f"engine-abort:{ctx.id}"
        )
        self._abort_tasks.add(task)
        task.add_done_callback(self._abort_tasks.discard)

    async def _abort(self, ctx: Context) -> None:
        try:
            await self.engine.abort(ctx)
        except Exception:
            log.exception("engine.abort failed for %s", ctx.id)

    async def wait_aborts(self) -> None:
        """Await outstanding abort calls (shutdown)."""
        if self._abort_tasks:
            await asyncio.gather(*list(self._abort_tasks), return_exceptions=True)


class _Payload:
    """The request-plane side of one ``handle`` stream: its ``handle_payload`` span and the
    bytes received and sent."""

    __slots__ = ("span", "received", "sent")

    def __init__(self, span: Span, received: int) -> None:
        self.span = span
        self.received = received
        self.sent = 0


class _GenerateTrace:
    """What the ``engine.generate`` span records over one stream (see the module docstring)."""

    __slots__ = ("span", "per_chunk", "started", "first_at", "last_at", "itls", "tokens", "reason")

    def __init__(self, span: Span, per_chunk: bool) -> None:
        self.span = span
        self.per_chunk = per_chunk
        self.started = time.monotonic()
        self.first_at: float | None = None
        self.last_at = 0.0
        self.itls: list[float] = []
        self.tokens = 0
        self.reason: str | None = None

    def chunk(self, output: LLMEngineOutput) -> None:
        """Per chunk: a count unless spans are recorded (then the timing too)."""
        ids = output.token_ids
        if ids:
            self.tokens += len(ids)
            if self.first_at is None:
                self._first(output)
            elif self.per_chunk:  # inline: a call less per chunk
                now = time.monotonic()
                self.itls.append((now - self.last_at) * 1000.0)
                self.last_at = now
        if output.finish_reason is not None:
            self.reason = output.finish_reason.value
            if output.finish_reason is FinishReason.ERROR:
                self.error("EngineError", output.error or "engine error")

    def _first(self, output: LLMEngineOutput) -> None:
        """The first chunk with tokens: the TTFT, and the stream's link while recording."""
        now = self.first_at = self.last_at = time.monotonic()
        self.span.set_attribute("ttft_ms", (now - self.started) * 1000.0)
        if self.per_chunk:
            output.worker_trace_link = tracing.link_of(self.span)

    def error(self, kind: str, message: str) -> None:
        self.span.set_attribute("error_kind", kind)
        self.span.set_status(Status(StatusCode.ERROR, f"{kind}: {message}"))

    def end(self, cancelled: bool) -> None:
        span = self.span
        if log.isEnabledFor(logging.DEBUG):
            with tracing.use(span):
                log.debug("engine.generate done: %d tokens, %s", self.tokens, self.reason)
        if span.is_recording():  # a local span keeps no attributes: none are built for it
            attributes: dict[str, str | int | float] = {
                "output_tokens": self.tokens,
                "cancelled": cancelled,
            }
            if self.reason is not None:
                attributes["finish_reason"] = self.reason
            itls = self.itls
            if itls:
                itls.sort()
                n = len(itls)
                attributes["avg_itl_ms"] = sum(itls) / n
                attributes["itl_p50_ms"] = itls[(n - 1) // 2]
                attributes["itl_p99_ms"] = itls[min(n - 1, int(n * 0.99))]
                attributes["itl_max_ms"] = itls[-1]
            span.set_attributes(attributes)
        span.end()
