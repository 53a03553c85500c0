"""The generate endpoints (/v1/chat/completions, /v1/completions): parse, admit and format.

Everything a request holds (ids, context, stats, router loads, admission ticket, metrics)
belongs to its :class:`InflightRequest`; the tokens come from ``choice.run_choices`` (choices
over attempts). The handler turns them into an SSE stream or one JSON response, and every path
ends in the request's ``finish()``.

Order of admission: the body is read first (a client slow to send it holds only its connection,
which the body timeout ends, never an in-flight place), then the frontend-wide in-flight limit,
then the model's capacity (``admission.py``). Decoding and preprocessing of a large body run off
the event loop (``offload.py``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from opentelemetry import context as otel_context

from dynamo.frontend.admission import Admission
from dynamo.frontend.attempt import Timeouts
from dynamo.frontend.capabilities import check_supported
from dynamo.frontend.choice import run_choices
from dynamo.frontend.disconnect import DISCONNECT_WATCH_AFTER_S, DisconnectWatch, watch_disconnect
from dynamo.frontend.errors import HTTPError, to_http
from dynamo.frontend.exchange import ClientDisconnected, Exchange
from dynamo.frontend.heap_trim import TRIM_AFTER_BYTES
from dynamo.frontend.inflight import InflightRequest
from dynamo.frontend.keepalive import KeepAliveSink
from dynamo.frontend.large_body import TooLong, decode, decode_checked
from dynamo.frontend.logprobs import ResponseExtras, TokenLogprobs, response_extras
from dynamo.frontend.migration import MigrationPolicy
from dynamo.frontend.model_registry import ModelEntry, ModelRegistry
from dynamo.frontend.offload import PROCESS_ABOVE_BYTES, Offload
from dynamo.frontend.pipeline import ChoiceDelta, ModelPipeline, RunStats
from dynamo.frontend.request_params import (
    plan_request,
    prepare_request,
    wants,
    wants_timing,
)
from dynamo.frontend.streaming import (
    DONE,
    JSON_HEADERS,
    SSE_HEADERS,
    ChatFormatter,
    CompletionFormatter,
    Formatter,
    sse,
    usage,
)
from dynamo.frontend.timing import timing_info
from dynamo.observability import tracing
from dynamo.observability.metrics import FrontendMetrics
from dynamo.preprocess import Prepared, Preprocessor
from dynamo.protocol.openai import ChatCompletionRequest, CompletionRequest
from dynamo.runtime.context import Context
from dynamo.runtime.errors import InvalidArgument, NoInstances, Overloaded

OpenAIRequest = ChatCompletionRequest | CompletionRequest


MAX_JSON_BYTES_PER_CHAR = 12
BODY_SLACK_BYTES = 1024 * 1024


class GenerateHandler:
    """Admission (drain, in-flight limit), parsing and response formatting."""

    def __init__(
        self,
        registry: ModelRegistry[ModelPipeline],
        metrics: FrontendMetrics,
        *,
        max_inflight: int,
        body_limit: int,
        overload_status: int,
        namespace: str = "dynamo",
        timeouts: Timeouts | None = None,
        migration: MigrationPolicy | None = None,
        keep_alive_s: float = 0.0,
        admission: Admission | None = None,
        offload: Offload | None = None,
    ) -> None:
        self._registry = registry
        self._m = metrics
        self._max_inflight = max_inflight
        self._body_limit = body_limit
        self._overload_status = overload_status
        self._timeouts = timeouts or Timeouts()
        self._migration = migration or MigrationPolicy(metrics=metrics)
        self._keep_alive_s = keep_alive_s
        self.namespace = namespace
        self.draining = False
        self._live: set[InflightRequest] = set()
        # Called once with every finished request (the dashboard).
        self.observers: list[Callable[[InflightRequest], None]] = []
        self.admission = admission or Admission()
        self.offload = offload or Offload()

    @property
    def inflight(self) -> int:
        """Admitted requests not finished yet."""
        return len(self._live)

    def cancel_all(self) -> None:
        """Stop every request in flight (shutdown after the grace period)."""
        for request in list(self._live):
            request.stop()

    def _finished(self, inflight: InflightRequest) -> None:
        self._live.discard(inflight)
        for observe in self.observers:
            observe(inflight)

    # -- entry points ----------------------------------------------------------------------
    async def chat(self, http: Exchange) -> None:
        await self._serve(http, "chat_completions")

    async def completion(self, http: Exchange) -> None:
        await self._serve(http, "completions")

    async def _serve(self, http: Exchange, endpoint: str) -> None:
        inflight = InflightRequest(
            http, self._m, endpoint, namespace=self.namespace, on_finish=self._finished
        )
        # The request's span is current for this handler task (its log lines carry the trace
        # id; the worker's spans join it through the request's traceparent).
        token = otel_context.attach(tracing.in_span(inflight.span))
        body_bytes = 0
        try:
            body_bytes = await self._admit_and_serve(http, endpoint, inflight)
        finally:
            otel_context.detach(token)
            declared = http.header("content-length") or ""
            if declared.isdigit():  # also when the request failed or was cancelled
                body_bytes = max(body_bytes, int(declared))
            if body_bytes >= TRIM_AFTER_BYTES:
                # The request's frame is gone, and with it its last reference to the body.
                self.offload.trim_memory()

    async def _admit_and_serve(
        self, http: Exchange, endpoint: str, inflight: InflightRequest
    ) -> int:
        """Serve one request; returns the size of its body (0 if none was read)."""
        if self.draining:
            inflight.fail(http, NoInstances("the frontend is shutting down"))
            return 0
        try:
            body = await http.body(self._useful_body_limit())
        except ClientDisconnected:
            # a half-closed client may still read: tell it (400), but count a cancellation
            reply = to_http(HTTPError(400, "the request body ended before its declared end"))
            http.reply(reply.status, [*JSON_HEADERS, *inflight.id_headers], reply.body)
            inflight.disconnected()
            return 0
        except Exception as exc:
            inflight.fail(http, exc, self._overload_status)
            return 0
        body_bytes = len(body)
        if len(self._live) >= self._max_inflight:
            inflight.fail(http, Overloaded("too many requests in flight"), self._overload_status)
            return body_bytes
        self._live.add(inflight)
        try:
            try:
                req = await self._decode(endpoint, body)
                del body  # a large prompt's bytes are not held while it is served
                inflight.request_type = "stream" if req.stream else "unary"
                entry = self._registry.get(req.model)
                inflight.model = req.model
                assert entry.pipeline is not None  # get() returns servable models only
                serving = entry.serving()
                check_supported(req, serving.capabilities)
                inflight.ticket = self.admission.admit(req.model, serving.cards)
                preprocessor = entry.pipeline.preprocessor
                inflight.worker_type = serving.role.value
                with (
                    self._m.stage("preprocess"),
                    tracing.tracer().start_as_current_span("preprocess") as span,
                ):
                    began = time.perf_counter()
                    prepared, extras = await self._prepare(preprocessor, req, inflight)
                    elapsed_ms = (time.perf_counter() - began) * 1000.0
                    self._m.meters.model(req.model).tokenizer_latency.observe(elapsed_ms)
                    span.set_attribute("input_tokens", prepared[0].num_prompt_tokens)
            except Exception as exc:
                inflight.fail(http, exc, self._overload_status)
                return body_bytes
            created = int(time.time())
            fmt: Formatter
            if isinstance(req, ChatCompletionRequest):
                fmt = ChatFormatter(f"chatcmpl-{inflight.request_id}", req.model, created, extras)
            else:
                fmt = CompletionFormatter(f"cmpl-{inflight.request_id}", req.model, created, extras)
            ctx = inflight.begin(prepared, req.n, fmt)
            if req.stream:
                await self._stream(http, inflight, entry, req, prepared, ctx, fmt)
            else:
                await self._unary(http, inflight, entry, req, prepared, ctx, fmt)
        except asyncio.CancelledError:
            inflight.finish("error", "cancelled")
            raise
        finally:
            inflight.finish("error", "internal")  # a backstop: a no-op once finished
        return body_bytes

    async def _prepare(
        self, preprocessor: Preprocessor, req: OpenAIRequest, inflight: InflightRequest
    ) -> tuple[list[Prepared], ResponseExtras | None]:
        """Template, tokenize and shape ``req``: a large one whole on the offload pool; else the
        template here and the tokenization, when other requests are in flight, on the tokenizer
        thread (it releases the GIL: the loop serves them meanwhile)."""
        size = _prompt_size(req)
        if not self.offload.inline(size):
            return await self.offload.run(size, _prepare_whole, preprocessor, req, inflight)
        plan = plan_request(preprocessor, req, inflight.engine_id, inflight.priority_headers)
        alone = len(self._live) <= 1
        token_ids = await self.offload.encode(preprocessor, plan.prompts, inline=alone)
        prepared = plan.prepared(preprocessor, token_ids)
        return prepared, response_extras(req, prepared, preprocessor.tokenizer)

    def _useful_body_limit(self) -> int:
        """The body limit, lowered to the largest body a served model's context can use: a
        prompt that fits has at most ``max_prompt_chars`` characters, each at most 12 bytes of
        JSON (an escaped surrogate pair), plus 1 MiB for the other fields. A larger body is
        refused (413) before it is read, copied or decoded."""
        most = 0
        for entry in self._registry.models():
            pipeline = entry.pipeline
            limit = None if pipeline is None else pipeline.preprocessor.max_prompt_chars
            if limit is None:
                return self._body_limit  # a model without a bound: any body may be useful
            most = max(most, limit)
        if not most:
            return self._body_limit
        return min(self._body_limit, most * MAX_JSON_BYTES_PER_CHAR + BODY_SLACK_BYTES)

    async def _decode(self, endpoint: str, body: bytes) -> OpenAIRequest:
        """The request in ``body``: decoded inline, on a thread, or (very large) in the helper
        process, which also refuses a prompt that cannot fit its model's context."""
        if len(body) <= PROCESS_ABOVE_BYTES:
            return await self.offload.run(len(body), decode, endpoint, body)
        limits = {}
        for entry in self._registry.models():
            if entry.pipeline is not None:
                limit = entry.pipeline.preprocessor.max_prompt_chars
                if limit is not None:
                    limits[entry.name] = limit
        result = await self.offload.run_in_process(decode_checked, endpoint, body, limits)
        if isinstance(result, TooLong):
            raise InvalidArgument(
                f"the prompt of {result.chars} characters exceeds this model's maximum context "
                f"length (at most {result.limit} characters fit); shorten the prompt"
            )
        return result

    # -- streaming ---------------------------------------------------------------------------
    async def _stream(
        self,
        http: Exchange,
        inflight: InflightRequest,
        entry: ModelEntry[ModelPipeline],
        req: OpenAIRequest,
        prepared: list[Prepared],
        ctx: Context,
        fmt: Formatter,
    ) -> None:
        stats = inflight.stats
        assert stats is not None
        want_ids = wants(req, "token_ids")
        deltas = run_choices(
            entry,
            prepared,
            ctx,
            stats,
            inflight.loads,
            self._timeouts,
            want_token_ids=want_ids,
            migration=self._migration,
        )
        # Route and reach the worker before committing to 200: an error before the first
        # event is an HTTP error response (FACTS §10.2). A client that goes away meanwhile
        # (held in the router queue, a long prefill) stops the request.
        disconnect = DisconnectWatch(http, ctx, DISCONNECT_WATCH_AFTER_S)
        try:
            first = await anext(deltas, None)
        except Exception as exc:
            if disconnect.done():
                inflight.disconnected()
            else:
                inflight.fail(http, exc, self._overload_status)
            disconnect.cancel()
            await deltas.aclose()
            return
        except BaseException:  # cancelled: the watch goes with the request
            disconnect.cancel()
            raise
        disconnect.activity()
        inflight.first_response()
        sink = KeepAliveSink(
            http.start_stream(200, [*SSE_HEADERS, *inflight.id_headers]), self._keep_alive_s
        )
        try:
            # Writes are batched where the order allows: the preamble with the first delta,
            # the last delta's trailers with [DONE] (one write to the client each).
            head = _preamble(req, prepared, fmt, inflight.request_id)
            if first is not None:
                head.extend(_delta_chunks(fmt, first, want_ids))
            await sink.send(b"".join(head))
            async for delta in deltas:
                disconnect.activity()
                if delta.token_ids is None and delta.finish_reason is None:
                    await sink.send(fmt.delta_chunk(delta.index, delta.text, None, delta.logprobs))
                else:
                    await sink.send(b"".join(_delta_chunks(fmt, delta, want_ids)))
            tail: list[bytes] = []
            final = _final_extras(req, stats)
            if final:
                tail.append(fmt.extra_chunk(final))
            if req.stream_options is not None and req.stream_options.include_usage:
                u = usage(stats.prompt_tokens, stats.completion_tokens, stats.cached_tokens)
                tail.append(fmt.usage_chunk(u))
            tail.append(DONE)
            await sink.send(b"".join(tail))
            inflight.finish()
        except Exception as exc:
            if disconnect.done() or isinstance(exc, ClientDisconnected):
                inflight.disconnected()
                return
            reply = to_http(exc, self._overload_status)  # once: it logs unexpected errors
            try:  # an error after streaming began: an SSE error event, then [DONE]
                await sink.send(sse(reply.body, "error") + DONE)
            except Exception:
                pass
            inflight.finish("error", reply.error_type)
        finally:
            sink.close()
            disconnect.cancel()
            await deltas.aclose()

    # -- unary -------------------------------------------------------------------------------
    async def _unary(
        self,
        http: Exchange,
        inflight: InflightRequest,
        entry: ModelEntry[ModelPipeline],
        req: OpenAIRequest,
        prepared: list[Prepared],
        ctx: Context,
        fmt: Formatter,
    ) -> None:
        stats = inflight.stats
        assert stats is not None
        texts: list[list[str]] = [[] for _ in prepared]
        reasons: list[str | None] = [None] * len(prepared)
        logprobs: list[list[TokenLogprobs | None]] = [[] for _ in prepared]
        want_ids = wants(req, "token_ids")
        token_ids: list[int] = []
        disconnect = watch_disconnect(http, ctx)
        deltas = run_choices(
            entry,
            prepared,
            ctx,
            stats,
            inflight.loads,
            self._timeouts,
            want_token_ids=want_ids,
            migration=self._migration,
        )
        try:
            async for delta in deltas:
                inflight.first_response()
                texts[delta.index].append(delta.text)
                logprobs[delta.index].append(delta.logprobs)
                if delta.finish_reason is not None:
                    reasons[delta.index] = delta.finish_reason
                if delta.token_ids:
                    token_ids.extend(delta.token_ids)
        except Exception as exc:
            if disconnect.done() or isinstance(exc, ClientDisconnected):
                inflight.disconnected()
            else:
                inflight.fail(http, exc, self._overload_status)
            return
        finally:
            disconnect.cancel()
            await deltas.aclose()
        nvext: dict[str, object] = {}
        if wants(req, "request_id"):
            nvext["request_id"] = inflight.request_id
        if wants(req, "formatted_prompt"):
            nvext["formatted_prompt"] = prepared[0].formatted_prompt
        if want_ids:
            nvext["token_ids"] = token_ids
        nvext.update(_final_extras(req, stats) or {})
        u = usage(stats.prompt_tokens, stats.completion_tokens, stats.cached_tokens)
        lps = [TokenLogprobs.concat(pieces) for pieces in logprobs]
        body = fmt.response(["".join(t) for t in texts], reasons, u, nvext or None, lps)
        http.reply(200, [*JSON_HEADERS, *inflight.id_headers], body)
        inflight.finish()


def _prompt_size(req: OpenAIRequest) -> int:
    """About how many characters preprocessing will handle (decides inline or offloaded)."""
    if isinstance(req, CompletionRequest):
        prompt = req.prompt
        if isinstance(prompt, str):
            return len(prompt)
        return sum(len(p) if isinstance(p, str | list) else 1 for p in prompt)
    size = 0
    for message in req.messages:
        content = message.content
        if isinstance(content, str):
            size += len(content)
        elif content is not None:
            size += sum(len(str(part.get("text", ""))) for part in content)
    return size


def _prepare_whole(
    preprocessor: Preprocessor, req: OpenAIRequest, inflight: InflightRequest
) -> tuple[list[Prepared], ResponseExtras | None]:
    """Template, tokenize and shape ``req`` (pure CPU work: may run on the offload pool)."""
    prepared = prepare_request(preprocessor, req, inflight.engine_id, inflight.priority_headers)
    return prepared, response_extras(req, prepared, preprocessor.tokenizer)


# -- formatting helpers ----------------------------------------------------------------------
def _delta_chunks(fmt: Formatter, delta: ChoiceDelta, want_ids: bool) -> list[bytes]:
    out: list[bytes] = []
    if delta.token_ids is not None and want_ids:
        out.append(fmt.extra_chunk({"token_ids": delta.token_ids}, "token_ids"))
    out.append(fmt.delta_chunk(delta.index, delta.text, delta.finish_reason, delta.logprobs))
    return out


def _preamble(
    req: OpenAIRequest, prepared: list[Prepared], fmt: Formatter, request_id: str
) -> list[bytes]:
    out: list[bytes] = []
    if wants(req, "request_id"):
        out.append(fmt.extra_chunk({"request_id": request_id}, "request_id"))
    if wants(req, "formatted_prompt"):
        out.append(
            fmt.extra_chunk({"formatted_prompt": prepared[0].formatted_prompt}, "formatted_prompt")
        )
    for i in range(len(prepared)):
        role = fmt.role_chunk(i)
        if role is not None:
            out.append(role)
    return out


def _final_extras(req: OpenAIRequest, stats: RunStats) -> dict[str, object] | None:
    fields = (req.nvext.extra_fields or []) if req.nvext else []
    out: dict[str, object] = {}
    sel = stats.choices[0].selection
    if "worker_id" in fields and sel is not None:
        out["worker_id"] = {"decode_worker_id": sel.instance_id, "decode_dp_rank": sel.dp_rank}
    if wants_timing(req):
        out["timing"] = timing_info(
            started=stats.started_at,
            dispatched_at=stats.choices[0].dispatched_at,
            first_token_at=stats.first_token_at,
            prompt_tokens=stats.prompt_tokens,
            cached_tokens=stats.cached_tokens,
        )
    return out or None
