"""A frontend generate handler over fakes: a scripted worker (no request plane), a router that
counts what it is told, a fake HTTP exchange (no socket). Shared by the handler tests."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry

from dynamo.backend.engine import chunk, with_usage
from dynamo.frontend.attempt import Timeouts
from dynamo.frontend.generate import GenerateHandler
from dynamo.frontend.model_registry import ModelEntry
from dynamo.frontend.pipeline import ModelPipeline
from dynamo.observability.metrics import FrontendMetrics
from dynamo.preprocess import Preprocessor, demo_model_path, load_model_dir
from dynamo.protocol.model_card import ModelCard, WorkerRole
from dynamo.protocol.output import LLMEngineOutput
from dynamo.protocol.request import PreprocessedRequest
from dynamo.router.basic import Selection
from dynamo.runtime.context import Context
from dynamo.runtime.errors import DynamoError, ModelNotFound
from tests.fakes import FakeExchange, make_card

_MODEL = load_model_dir(demo_model_path())
PRE = Preprocessor(_MODEL, served_model_name="demo")
WORDS = _MODEL.tokenizer.encode(" alpha beta gamma delta epsilon zeta eta theta")
TEXT6 = _MODEL.tokenizer.decode(WORDS[:6])  # what the default Script's six tokens read
_enc = msgspec.msgpack.Encoder()
_req_dec = msgspec.msgpack.Decoder(PreprocessedRequest)


def card(instance_id: int) -> ModelCard:
    return make_card(instance_id, model_path=str(demo_model_path()), data_parallel_size=4)


@dataclass
class Script:
    """What the worker does for every request: send ``tokens`` (one chunk each) then finish, or
    fail with ``fail`` after ``fail_after`` tokens, or hang (``hang_after`` tokens: wait for a
    stop and answer ``cancelled``, or for ``release`` when set)."""

    tokens: list[int] = field(default_factory=lambda: WORDS[:6])
    fail: DynamoError | None = None
    fail_after: int = 0
    hang_after: int | None = None
    release: asyncio.Event | None = None
    silent: bool = False  # on hang: ignore stop (a worker that stopped answering)
    failing_streams: int | None = None  # only the first N streams fail/hang (None: all)


class ScriptedWorker:
    """The endpoint client the attempts talk to: streams encoded engine outputs per a Script."""

    def __init__(self, script: Script, ids: Sequence[int] = (1, 2)) -> None:
        self.script = script
        self.ids = list(ids)
        self.sent: list[PreprocessedRequest] = []
        self.targets: list[int] = []
        self.contexts: list[Context] = []
        self.down: list[int] = []
        self.open_streams = 0
        self._prompt_len: dict[str | None, int] = {}

    def instance_ids(self) -> list[int]:
        return [i for i in self.ids if i not in self.down]

    def report_down(self, instance_id: int) -> bool:
        if instance_id in self.down:
            return False
        self.down.append(instance_id)
        return True

    def stream_batches(
        self, body: bytes, ctx: Context, *, instance_id: int
    ) -> AsyncGenerator[list[bytes], None]:
        request = _req_dec.decode(body)
        self.sent.append(request)
        self.targets.append(instance_id)
        self.contexts.append(ctx)
        # A migrated request carries the tokens already sent in its prompt: continue after them.
        first_len = self._prompt_len.setdefault(request.request_id, len(request.token_ids))
        limit = self.script.failing_streams
        failing = limit is None or len(self.sent) <= limit
        return self._run(ctx, len(request.token_ids) - first_len, failing)

    async def _run(
        self, ctx: Context, skip: int = 0, failing: bool = True
    ) -> AsyncGenerator[list[bytes], None]:
        s = self.script
        self.open_streams += 1
        try:
            for i, tok in enumerate(s.tokens):
                if i < skip:
                    continue
                if failing and s.fail is not None and i == s.fail_after:
                    raise s.fail
                if failing and s.hang_after is not None and i == s.hang_after:
                    if s.release is not None:
                        await s.release.wait()
                    elif s.silent:
                        await asyncio.Event().wait()
                    else:
                        await ctx.stopped()
                        yield [_enc.encode(chunk.cancelled())]
                        return
                await asyncio.sleep(0)
                yield [_enc.encode(chunk.token(tok))]
            if failing and s.fail is not None and s.fail_after >= len(s.tokens):
                raise s.fail
            out: LLMEngineOutput = with_usage(chunk.length(), 10, len(s.tokens))
            yield [_enc.encode(out)]
        finally:
            self.open_streams -= 1


class CountingRouter:
    """Round-robin over candidates, DP rank = the choice's index; counts every call."""

    queue = None  # no router queue, no router series (the Router protocol's attributes)
    series = None

    def __init__(self) -> None:
        self.selected: Counter[str] = Counter()
        self.first_tokens: Counter[str] = Counter()
        self.finished: Counter[str] = Counter()
        self.workers: set[int] = set()
        self.closed = False
        self._next = 0

    def select(self, request: PreprocessedRequest, candidates: Sequence[ModelCard]) -> Selection:
        rid = request.request_id or ""
        self.selected[rid] += 1
        idx = self._next % len(candidates)
        self._next += 1
        rank = int(rid.rsplit("-", 1)[-1]) % 4 if rid.rsplit("-", 1)[-1].isdigit() else 0
        return Selection(candidates[idx].instance_id, rank)

    def on_first_token(self, request_id: str) -> None:
        self.first_tokens[request_id] += 1

    def on_finish(self, request_id: str) -> None:
        self.finished[request_id] += 1

    def add_worker(self, card: ModelCard) -> None:
        self.workers.add(card.instance_id)

    def remove_worker(self, instance_id: int) -> None:
        self.workers.discard(instance_id)

    async def close(self) -> None:
        self.closed = True

    @property
    def outstanding(self) -> int:
        """Routed requests whose load was not freed."""
        return sum(1 for rid in self.selected if self.finished[rid] == 0)


class FakeRegistry:
    def __init__(self, entry: ModelEntry[ModelPipeline]) -> None:
        self.entry = entry

    def models(self) -> list[ModelEntry[ModelPipeline]]:
        return [self.entry]

    def get(self, name: str) -> ModelEntry[ModelPipeline]:
        if name != self.entry.name:
            raise ModelNotFound(f"The model `{name}` does not exist")
        return self.entry


@dataclass
class Kit:
    handler: GenerateHandler
    metrics: FrontendMetrics
    worker: ScriptedWorker
    router: CountingRouter

    def requests_total(self) -> dict[tuple[str, ...], float]:
        """requests_total samples with a non-zero value, by (status, error_type)."""
        out: dict[tuple[str, ...], float] = {}
        for family in self.metrics.registry.collect():
            for sample in family.samples:
                if sample.name.endswith("_requests_total") and sample.value:
                    key = (sample.labels["status"], sample.labels["error_type"])
                    out[key] = out.get(key, 0) + sample.value
        return out

    def gauge(self, name: str) -> float:
        value = self.metrics.registry.get_sample_value(f"dynamo_frontend_{name}", {"model": "demo"})
        return value or 0.0

    async def call(
        self, body: dict[str, Any], path: str = "/v1/chat/completions", **kw: Any
    ) -> FakeExchange:
        http = FakeExchange(json.dumps(body).encode(), path=path, **kw)
        if path.endswith("chat/completions"):
            await self.handler.chat(http)
        else:
            await self.handler.completion(http)
        return http

    def assert_routed_and_freed_once(self, n: int = 1) -> None:
        assert len(self.router.selected) == n
        assert all(v == 1 for v in self.router.selected.values()), self.router.selected
        assert self.router.finished == Counter(self.router.selected), self.router.finished
        assert all(v <= 1 for v in self.router.first_tokens.values())


def make_kit(script: Script | None = None, **handler_kw: Any) -> Kit:
    worker = ScriptedWorker(script or Script())
    router = CountingRouter()
    entry: ModelEntry[ModelPipeline] = ModelEntry(
        "demo",
        None,
        pipeline=ModelPipeline("demo", PRE),
        cards={1: card(1), 2: card(2)},
        clients={WorkerRole.AGGREGATED: worker},  # type: ignore[dict-item]
        routers={WorkerRole.AGGREGATED: router},
    )
    metrics = FrontendMetrics("dynamo_frontend", CollectorRegistry())
    handler_kw.setdefault("timeouts", Timeouts(5.0, 5.0))
    handler = GenerateHandler(
        FakeRegistry(entry),  # type: ignore[arg-type]
        metrics,
        max_inflight=handler_kw.pop("max_inflight", 16),
        body_limit=1 << 20,
        overload_status=529,
        **handler_kw,
    )
    return Kit(handler, metrics, worker, router)


def sse_events(text: str) -> list[str]:
    """The data payloads of an SSE body (comments dropped)."""
    return [line.removeprefix("data: ") for line in text.split("\n") if line.startswith("data: ")]
