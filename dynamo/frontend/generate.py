"""The generate endpoints (/v1/chat/completions, /v1/completions): parse, admit, preprocess,
stream or fold, and account (metrics, router load, disconnects)."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import TYPE_CHECKING, Any

import msgspec

from dynamo.frontend.capabilities import check_supported, serving_capabilities
from dynamo.frontend.errors import error_payload, to_http
from dynamo.frontend.logprobs import TokenLogprobs, response_extras
from dynamo.frontend.model_registry import ModelEntry, ModelRegistry
from dynamo.frontend.pipeline import (
    ChoiceDelta,
    ChoiceStats,
    ModelPipeline,
    RunStats,
    run_choices,
)
from dynamo.frontend.request_params import prepare_request, wants, wants_timing
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
from dynamo.observability.metrics import FrontendMetrics, observe_many
from dynamo.preprocess import Prepared
from dynamo.protocol.openai import ChatCompletionRequest, CompletionRequest
from dynamo.runtime.context import Context
from dynamo.runtime.errors import NoInstances, Overloaded

if TYPE_CHECKING:
    from dynamo.frontend.routes import Exchange

_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
_completion_decoder = msgspec.json.Decoder(CompletionRequest)


class GenerateHandler:
    def __init__(
        self,
        registry: ModelRegistry[ModelPipeline],
        metrics: FrontendMetrics,
        *,
        max_inflight: int,
        body_limit: int,
        overload_status: int,
        namespace: str = "dynamo",
    ) -> None:
        self._registry = registry
        self._m = metrics
        self._max_inflight = max_inflight
        self._body_limit = body_limit
        self._overload_status = overload_status
        self.namespace = namespace
        self.inflight = 0
        self.draining = False
        self._contexts: set[Context] = set()

    def cancel_all(self) -> None:
        """Stop every request in flight (shutdown after the grace period)."""
        for ctx in list(self._contexts):
            ctx.stop_generating()

    # -- entry points ----------------------------------------------------------------------
    async def chat(self, http: Exchange) -> None:
        await self._serve(http, "chat_completions")

    async def completion(self, http: Exchange) -> None:
        await self._serve(http, "completions")

    async def _serve(self, http: Exchange, endpoint: str) -> None:
        started = time.monotonic()
        client_id = http.header("x-dynamo-request-id") or http.header("x-request-id")
        request_id = client_id or uuid.uuid4().hex
        id_headers = [("x-request-id", request_id), ("x-dynamo-request-id", request_id)]
        # The id the engines, router and request plane see must be unique: a client may reuse
        # its x-request-id (retries), and a cancel by context id must not hit the other request.
        engine_id = request_id if client_id is None else f"{client_id}-{uuid.uuid4().hex[:12]}"
        model = "unknown"
        request_type = "unary"
        if self.draining:
            self._fail(
                http,
                NoInstances("the frontend is shutting down"),
                model,
                endpoint,
                request_type,
                id_headers,
            )
            return
        if self.inflight >= self._max_inflight:
            self._fail(
                http,
                Overloaded("too many requests in flight"),
                model,
                endpoint,
                request_type,
                id_headers,
            )
            return
        self.inflight += 1
        try:
            try:
                body = await http.body(self._body_limit)
                req: ChatCompletionRequest | CompletionRequest
                if endpoint == "chat_completions":
                    req = _chat_decoder.decode(body)
                else:
                    req = _completion_decoder.decode(body)
                request_type = "stream" if req.stream else "unary"
                entry = self._registry.get(req.model)
                # Only served model names become metric labels: a client naming arbitrary
                # models must not grow the label set without bound.
                model = req.model
                check_supported(req, serving_capabilities(entry.cards_of(entry.serving_role())))
                prepared = prepare_request(entry.pipeline.preprocessor, req, engine_id)
                extras = response_extras(req, prepared, entry.pipeline.preprocessor.tokenizer)
            except Exception as exc:
                self._fail(http, exc, model, endpoint, request_type, id_headers)
                return
            created = int(time.time())
            fmt: Formatter
            if isinstance(req, ChatCompletionRequest):
                fmt = ChatFormatter(f"chatcmpl-{request_id}", req.model, created, extras)
            else:
                fmt = CompletionFormatter(f"cmpl-{request_id}", req.model, created, extras)
            ctx = Context(engine_id)
            self._contexts.add(ctx)
            stats = RunStats(
                [ChoiceStats() for _ in prepared],
                prompt_tokens=sum(p.num_prompt_tokens for p in prepared) // req.n,
                started_at=started,
            )
            self._m.active_requests.labels(model).inc()
            self._m.inflight_requests.labels(model).inc()
            status, error_type = "success", ""
            try:
                if req.stream:
                    status, error_type = await self._stream(
                        http, entry, req, prepared, ctx, stats, fmt, id_headers
                    )
                else:
                    status, error_type = await self._unary(
                        http, entry, req, prepared, ctx, stats, fmt, id_headers
                    )
            finally:
                self._contexts.discard(ctx)
                self._m.active_requests.labels(model).dec()
                self._m.inflight_requests.labels(model).dec()
                self._record(model, endpoint, request_type, status, error_type, started, stats)
        finally:
            self.inflight -= 1

    # -- streaming ---------------------------------------------------------------------------
    async def _stream(
        self,
        http: Exchange,
        entry: ModelEntry[ModelPipeline],
        req: ChatCompletionRequest | CompletionRequest,
        prepared: list[Prepared],
        ctx: Context,
        stats: RunStats,
        fmt: Formatter,
        id_headers: list[tuple[str, str]],
    ) -> tuple[str, str]:
        deltas = run_choices(entry, prepared, ctx, stats, want_token_ids=wants(req, "token_ids"))
        # Route and reach the worker before committing to 200: an error before the first
        # event is an HTTP error response (FACTS §10.2).
        first: Any = None
        try:
            first = await anext(deltas, None)
        except Exception as exc:
            self._fail(http, exc, req.model, _endpoint(fmt), "stream", id_headers)
            return "error", to_http(exc).error_type
        sink = http.start_stream(200, [*SSE_HEADERS, *id_headers])
        disconnect = _watch_disconnect(http, ctx)
        want_ids = wants(req, "token_ids")
        try:
            # Writes are batched where the order allows: the preamble with the first delta,
            # the last delta's trailers with [DONE] (one write to the client each).
            head = self._preamble(req, prepared, fmt, request_id=_echoed_id(id_headers))
            if first is not None:
                head.extend(self._delta_chunks(fmt, first, want_ids))
            await sink.send(b"".join(head))
            async for delta in deltas:
                if delta.token_ids is None and delta.finish_reason is None:
                    await sink.send(fmt.delta_chunk(delta.index, delta.text, None, delta.logprobs))
                else:
                    await sink.send(b"".join(self._delta_chunks(fmt, delta, want_ids)))
            tail: list[bytes] = []
            final = self._final_extras(req, stats)
            if final:
                tail.append(fmt.extra_chunk(final))
            if req.stream_options is not None and req.stream_options.include_usage:
                u = usage(stats.prompt_tokens, stats.completion_tokens, stats.cached_tokens)
                tail.append(fmt.usage_chunk(u))
            tail.append(DONE)
            await sink.send(b"".join(tail))
            return "success", ""
        except Exception as exc:
            if disconnect.done():
                self._count_disconnect(req.model, _endpoint(fmt), "stream")
                return "error", "cancelled"
            reply = to_http(exc, self._overload_status)
            try:  # an error after streaming began: an SSE error event, then [DONE]
                await sink.send(sse(error_payload(exc), "error"))
                await sink.send(DONE)
            except Exception:
                pass
            return "error", reply.error_type
        finally:
            disconnect.cancel()
            await deltas.aclose()

    @staticmethod
    def _delta_chunks(fmt: Formatter, delta: ChoiceDelta, want_ids: bool) -> list[bytes]:
        out: list[bytes] = []
        if delta.token_ids is not None and want_ids:
            out.append(fmt.extra_chunk({"token_ids": delta.token_ids}, "token_ids"))
        out.append(fmt.delta_chunk(delta.index, delta.text, delta.finish_reason, delta.logprobs))
        return out

    def _count_disconnect(self, model: str, endpoint: str, request_type: str) -> None:
        self._m.disconnected_clients.inc()
        self._m.model_cancellation.labels(model, endpoint, request_type).inc()

    def _preamble(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        prepared: list[Prepared],
        fmt: Formatter,
        *,
        request_id: str,
    ) -> list[bytes]:
        out: list[bytes] = []
        if wants(req, "request_id"):
            out.append(fmt.extra_chunk({"request_id": request_id}, "request_id"))
        if wants(req, "formatted_prompt"):
            out.append(
                fmt.extra_chunk(
                    {"formatted_prompt": prepared[0].formatted_prompt}, "formatted_prompt"
                )
            )
        for i in range(len(prepared)):
            role = fmt.role_chunk(i)
            if role is not None:
                out.append(role)
        return out

    def _final_extras(self, req: Any, stats: RunStats) -> dict[str, object] | None:
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

    # -- unary -------------------------------------------------------------------------------
    async def _unary(
        self,
        http: Exchange,
        entry: ModelEntry[ModelPipeline],
        req: ChatCompletionRequest | CompletionRequest,
        prepared: list[Prepared],
        ctx: Context,
        stats: RunStats,
        fmt: Formatter,
        id_headers: list[tuple[str, str]],
    ) -> tuple[str, str]:
        texts: list[list[str]] = [[] for _ in prepared]
        reasons: list[str | None] = [None] * len(prepared)
        logprobs: list[list[TokenLogprobs | None]] = [[] for _ in prepared]
        want_ids = wants(req, "token_ids")
        token_ids: list[int] = []
        disconnect = _watch_disconnect(http, ctx)
        try:
            async for delta in run_choices(entry, prepared, ctx, stats, want_token_ids=want_ids):
                texts[delta.index].append(delta.text)
                logprobs[delta.index].append(delta.logprobs)
                if delta.finish_reason is not None:
                    reasons[delta.index] = delta.finish_reason
                if delta.token_ids:
                    token_ids.extend(delta.token_ids)
        except Exception as exc:
            if disconnect.done():
                self._count_disconnect(req.model, _endpoint(fmt), "unary")
                return "error", "cancelled"
            self._fail(http, exc, req.model, _endpoint(fmt), "unary", id_headers)
            return "error", to_http(exc).error_type
        finally:
            disconnect.cancel()
        nvext: dict[str, object] = {}
        if wants(req, "request_id"):
            nvext["request_id"] = _echoed_id(id_headers)
        if wants(req, "formatted_prompt"):
            nvext["formatted_prompt"] = prepared[0].formatted_prompt
        if want_ids:
            nvext["token_ids"] = token_ids
        nvext.update(self._final_extras(req, stats) or {})
        u = usage(stats.prompt_tokens, stats.completion_tokens, stats.cached_tokens)
        lps = [TokenLogprobs.concat(pieces) for pieces in logprobs]
        body = fmt.response(["".join(t) for t in texts], reasons, u, nvext or None, lps)
        http.reply(200, [*JSON_HEADERS, *id_headers], body)
        return "success", ""

    # -- accounting ----------------------------------------------------------------------------
    def _fail(
        self,
        http: Exchange,
        exc: BaseException,
        model: str,
        endpoint: str,
        request_type: str,
        extra_headers: list[tuple[str, str]],
    ) -> None:
        reply = to_http(exc, self._overload_status)
        if reply.error_type == "overload":
            self._m.model_rejection.labels(model, endpoint).inc()
        self._m.requests.labels(model, endpoint, request_type, "error", reply.error_type).inc()
        http.reply(reply.status, [*JSON_HEADERS, *reply.headers, *extra_headers], reply.body)

    def _record(
        self,
        model: str,
        endpoint: str,
        request_type: str,
        status: str,
        error_type: str,
        started: float,
        stats: RunStats,
    ) -> None:
        m = self._m
        m.requests.labels(model, endpoint, request_type, status, error_type).inc()
        m.request_duration.labels(model).observe(time.monotonic() - started)
        ns = self.namespace
        m.input_tokens.labels(model, ns).observe(stats.prompt_tokens)
        m.output_tokens.labels(model).observe(stats.completion_tokens)
        m.output_tokens_total.labels(model, ns).inc(stats.completion_tokens)
        first = stats.first_token_at
        if first is not None:
            m.ttft.labels(model).observe(first - started)
        itl = m.itl.labels(model)
        for choice in stats.choices:
            observe_many(itl, choice.itls)
        if stats.cached_tokens is not None:
            m.cached_tokens.labels(model).observe(stats.cached_tokens)


def _watch_disconnect(http: Exchange, ctx: Context) -> asyncio.Future[None]:
    """A future that resolves when the client goes away, stopping the request's context.
    Cancel it when the response is done."""
    watch = asyncio.ensure_future(http.disconnected())
    watch.add_done_callback(lambda f: None if f.cancelled() else ctx.stop_generating())
    return watch


def _echoed_id(id_headers: list[tuple[str, str]]) -> str:
    """The request id the client sees (its own x-request-id, or the one made up for it)."""
    return id_headers[0][1]


def _endpoint(fmt: Formatter) -> str:
    return "chat_completions" if isinstance(fmt, ChatFormatter) else "completions"
