"""Test builders and small engines (production fakes live in the package; these are test-only)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from dynamo.backend.engine import EngineConfig, LLMEngine, chunk, with_usage
from dynamo.protocol.model_card import ModelCard
from dynamo.protocol.output import LLMEngineOutput
from dynamo.protocol.request import PreprocessedRequest, StopConditions
from dynamo.runtime.context import Context
from dynamo.runtime.errors import InvalidArgument


def make_card(instance_id: int, **fields: Any) -> ModelCard:
    """A worker's model card: model ``demo`` at ``dynamo.backend.generate``, 4096 tokens of
    context, blocks of 16; ``fields`` override any of them (or set the others)."""
    card: dict[str, Any] = {
        "served_model_name": "demo",
        "model_path": "",
        "namespace": "dynamo",
        "component": "backend",
        "endpoint": "generate",
        "context_length": 4096,
        "kv_block_size": 16,
    }
    return ModelCard(instance_id=instance_id, **(card | fields))


def make_request(
    token_ids: list[int] | None = None, max_tokens: int = 8, model: str = "test-model", **kw: object
) -> PreprocessedRequest:
    return PreprocessedRequest(
        model=model,
        token_ids=token_ids if token_ids is not None else list(range(1, 17)),
        stop=StopConditions(max_tokens=max_tokens),
        **kw,  # type: ignore[arg-type]
    )


class CountingEngine(LLMEngine):
    """Emits tokens 0, 1, 2, ... every ``delay`` seconds; honours cancellation.

    A prompt whose first token is 666 raises InvalidArgument; 667 yields a string error terminal.
    Records the lifecycle for assertions.
    """

    def __init__(self, delay: float = 0.0, model: str = "test-model") -> None:
        self.delay = delay
        self.model = model
        self.events: list[str] = []
        self.aborted: list[str] = []
        self.active = 0

    async def start(self, worker_id: int) -> EngineConfig:
        self.events.append("start")
        return EngineConfig(model=self.model, context_length=4096, kv_block_size=16)

    async def generate(
        self, request: PreprocessedRequest, ctx: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        if request.token_ids and request.token_ids[0] == 666:
            raise InvalidArgument("token 666 is not allowed")
        if request.token_ids and request.token_ids[0] == 667:
            yield chunk.error("engine exploded")
            return
        self.active += 1
        try:
            n = request.stop.max_tokens or 8
            for i in range(n):
                if ctx.is_stopped():
                    yield chunk.cancelled()
                    return
                if self.delay:
                    await asyncio.sleep(self.delay)
                if i == n - 1:
                    out = chunk.length()
                    out.token_ids = [i]
                    yield with_usage(out, len(request.token_ids), n)
                else:
                    yield chunk.token(i)
        finally:
            self.active -= 1

    async def abort(self, ctx: Context) -> None:
        self.aborted.append(ctx.id)

    async def drain(self) -> None:
        self.events.append("drain")

    async def cleanup(self) -> None:
        self.events.append("cleanup")


class FakeExchange:
    """An in-memory HTTP exchange (the handlers' ``Exchange`` seam): no socket. Records the
    reply or the streamed chunks; :meth:`disconnect` makes the client go away."""

    def __init__(
        self,
        body: bytes,
        path: str = "/v1/chat/completions",
        method: str = "POST",
        headers: dict[str, str] | None = None,
    ) -> None:
        self.method = method
        self.path = path
        self._body = body
        self._headers = {k.lower(): v for k, v in (headers or {}).items()}
        self.status: int | None = None
        self.headers: list[tuple[str, str]] = []
        self.response = b""
        self.chunks: list[bytes] = []
        self.streaming = False
        self._gone = asyncio.Event()

    # -- the Exchange protocol ---------------------------------------------------------------
    def header(self, name: str) -> str | None:
        return self._headers.get(name.lower())

    async def body(self, limit: int) -> bytes:
        from dynamo.frontend.errors import HTTPError

        if len(self._body) > limit:
            raise HTTPError(413, f"request body exceeds the {limit}-byte limit")
        return self._body

    def reply(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        assert self.status is None, "answered twice"
        self.status, self.headers, self.response = status, headers, body

    def start_stream(self, status: int, headers: list[tuple[str, str]]) -> FakeExchange:
        assert self.status is None, "answered twice"
        self.status, self.headers, self.streaming = status, headers, True
        return self

    async def send(self, data: bytes) -> None:  # the stream sink
        if self._gone.is_set():
            raise ConnectionError("the client is gone")
        self.chunks.append(data)

    async def disconnected(self) -> None:
        await self._gone.wait()

    # -- test controls ---------------------------------------------------------------------------
    def disconnect(self) -> None:
        self._gone.set()

    @property
    def text(self) -> str:
        return (self.response if not self.streaming else b"".join(self.chunks)).decode()

    def json(self) -> Any:
        import json

        return json.loads(self.response)


class FakeTransport:
    """An asyncio transport that keeps what the protocol writes (``out``) and whether it
    closed: drives an HTTP protocol without a socket."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.closed = False

    def write(self, data: bytes) -> None:
        self.out += data

    def close(self) -> None:
        self.closed = True

    def can_write_eof(self) -> bool:
        return False
