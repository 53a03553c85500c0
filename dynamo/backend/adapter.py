"""``EngineAdapter``: runs ``engine.generate`` for the request plane.

Per request it (1) decodes the ``PreprocessedRequest``, (2) arms a cancellation monitor that calls
``engine.abort(ctx)`` when the context is stopped or killed, (3) validates the stream's terminal
rules, (4) turns unexpected exceptions into ``Unknown`` (typed ``DynamoError``s pass through so
they reach the client with their type) and (5) encodes each chunk.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import msgspec

from dynamo.backend.engine import LLMEngine
from dynamo.backend.validate import StreamValidator, strict_from_env
from dynamo.observability.metrics import WorkerMetrics
from dynamo.protocol.output import FinishReason, LLMEngineOutput
from dynamo.protocol.request import PreprocessedRequest
from dynamo.runtime.context import Context
from dynamo.runtime.errors import DynamoError, InvalidArgument, Unknown

log = logging.getLogger(__name__)

request_decoder = msgspec.msgpack.Decoder(PreprocessedRequest)
output_encoder = msgspec.msgpack.Encoder()


class EngineAdapter:
    """Bridges an :class:`LLMEngine` to a request-plane handler. Owns the abort tasks."""

    def __init__(
        self,
        engine: LLMEngine,
        *,
        strict: bool | None = None,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        """``strict``: raise on stream-contract violations instead of repairing them (None:
        ``DYN_STRICT_STREAM_VALIDATION``)."""
        self.engine = engine
        self.strict = strict_from_env() if strict is None else strict
        self.metrics = metrics
        self._abort_tasks: set[asyncio.Task[None]] = set()
        self.num_inflight = 0
        self.last_activity = time.monotonic()  # the latest output sent (health-check canaries)

    async def handle(self, body: bytes, ctx: Context) -> AsyncIterator[bytes]:
        """The request-plane handler: bytes in, encoded ``LLMEngineOutput`` chunks out."""
        try:
            request = request_decoder.decode(body)
        except msgspec.DecodeError as exc:
            raise InvalidArgument(f"malformed request: {exc}") from exc
        encode = output_encoder.encode
        async for output in self.generate(request, ctx):
            yield encode(output)

    async def generate(
        self, request: PreprocessedRequest, ctx: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        """Run one request through the engine with monitoring and validation."""
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
                        yield output
            except DynamoError as exc:
                validator.terminated = True
                if metrics is not None:
                    metrics.error(exc.kind)
                raise
            except Exception as exc:
                log.exception("engine error in request %s", ctx.id)
                if metrics is not None:
                    metrics.error("Unknown")
                raise Unknown(f"{type(exc).__name__}: {exc}") from exc
            repair = validator.finish()
            if repair is not None:
                yield repair
        finally:
            self.num_inflight -= 1
            remove_monitor()
            if metrics is not None:
                metrics.inflight.dec()
                metrics.requests.inc()
                metrics.duration.observe(time.monotonic() - started)
                if ctx.is_stopped():
                    metrics.cancellations.inc()

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
