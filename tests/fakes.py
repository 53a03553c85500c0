"""Test builders and small engines (production fakes live in the package; these are test-only)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from dynamo.backend.engine import EngineConfig, LLMEngine, chunk, with_usage
from dynamo.protocol.output import LLMEngineOutput
from dynamo.protocol.request import PreprocessedRequest, StopConditions
from dynamo.runtime.context import Context
from dynamo.runtime.errors import InvalidArgument


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
