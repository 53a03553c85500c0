"""``TorchEngine``: a real model behind ``LLMEngine`` (spec 000) on the shared engine core.

The model runs in a ``StepThread``; each pass's report comes back to the event loop with
``call_soon_threadsafe`` and lands in per-request collectors that coalesce tokens when a
consumer is slow (the step thread never waits for a consumer). KV events and load are handed
to the sinks in pass order by one publishing task, exactly as the mocker hands them.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

import msgspec

from dynamo.backend.engine import EngineConfig, GenerateContext, LLMEngine, RankMetrics
from dynamo.backend.kv_transfer import ExportedBlocks, KVTransferAgent
from dynamo.engine_core.scheduler import Scheduler
from dynamo.engine_core.sequence import Sequence, sequence_from_request
from dynamo.protocol.disagg import DisaggregatedParams
from dynamo.protocol.kv_events import KVEventBatch
from dynamo.protocol.load import WorkerLoad
from dynamo.protocol.model_card import EngineCapabilities
from dynamo.protocol.output import FinishReason, LLMEngineOutput, Usage
from dynamo.protocol.request import GuidedDecodingOptions, PreprocessedRequest
from dynamo.pytorch.collector import Collector
from dynamo.pytorch.config import TorchEngineConfig
from dynamo.pytorch.guided import decoder_for_model
from dynamo.pytorch.kv_cache import KVBlocks, KVLayout, merge_head_shards
from dynamo.pytorch.loader import LoadedModel, load_model
from dynamo.pytorch.metrics import rank_metrics
from dynamo.pytorch.sampler import (
    MAX_TOP_LOGPROBS,
    RequestSampler,
    SamplingParams,
    TokenConstraint,
    make_generator,
)
from dynamo.pytorch.step_thread import Abort, Add, Call, EngineStats, StepReport, StepThread
from dynamo.runtime.context import Context
from dynamo.runtime.errors import (
    CannotConnect,
    DynamoError,
    EngineShutdown,
    InvalidArgument,
    KVTransferFailed,
    StreamIncomplete,
    Unknown,
)

log = logging.getLogger(__name__)

T = TypeVar("T")
KVEventSink = Callable[[KVEventBatch], Awaitable[None]]
LoadSink = Callable[[WorkerLoad], Awaitable[None]]
ConstraintFactory = Callable[[GuidedDecodingOptions], Awaitable[TokenConstraint]]
"""Builds a request's guided-decoding matcher (raises ``InvalidArgument`` for a bad spec);
awaited on the event loop, so a slow compile must run in a worker thread."""


class TorchEngine(LLMEngine):
    """See ``LLMEngine`` for the lifecycle. Guided decoding uses ``constraint_factory`` when
    given, else llguidance matchers compiled for the model's tokenizer at start (when
    llguidance can read that tokenizer; otherwise guided requests are refused and the card
    does not advertise them)."""

    def __init__(
        self,
        config: TorchEngineConfig,
        *,
        kv_event_sink: KVEventSink | None = None,
        load_sink: LoadSink | None = None,
        constraint_factory: ConstraintFactory | None = None,
        transfer: KVTransferAgent | None = None,
    ) -> None:
        """``transfer``: the worker's KV transfer agent (disaggregation: a prefill engine serves
        its blocks through it, a decode engine pulls the prompt's blocks with it)."""
        self.config = config
        self.transfer = transfer
        self.kv_event_sink = kv_event_sink
        self.load_sink = load_sink
        self.constraint_factory = constraint_factory
        self.worker_id: int | None = None
        self.loaded: LoadedModel | None = None
        self._thread: StepThread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._collectors: dict[str, Collector] = {}
        self._ctx_keys: dict[str, set[str]] = {}
        self._keys = itertools.count()
        self._outbox: asyncio.Queue[KVEventBatch | WorkerLoad] = asyncio.Queue()
        self._publisher: asyncio.Task[None] | None = None
        self._last_load: WorkerLoad | None = None
        self._closed = False

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self, worker_id: int) -> EngineConfig:
        if self._thread is not None:
            raise RuntimeError("TorchEngine.start() called twice")
        self.worker_id = worker_id
        self._loop = asyncio.get_running_loop()
        loaded = self.loaded = await asyncio.to_thread(load_model, self.config)
        if self.constraint_factory is None:
            self.constraint_factory = await asyncio.to_thread(
                _guided_factory, self.config.model_path, loaded
            )
        scheduler = Scheduler(loaded.settings)
        thread = StepThread(scheduler, loaded.runner, self._report_threadsafe, worker_id=worker_id)
        thread.on_crash = self._crash_threadsafe
        self._thread = thread
        self._publisher = asyncio.create_task(self._publish_loop(), name="pytorch-publish")
        thread.start()
        s = loaded.settings
        if self.transfer is not None:
            layout = msgspec.to_builtins(loaded.cache.layout)
            await self.transfer.start(worker_id, layout, s.num_gpu_blocks)
        return EngineConfig(
            model=self.config.model_path,
            served_model_name=self.config.served_model_name,
            context_length=s.max_model_len,
            kv_block_size=s.block_size,
            total_kv_blocks=s.num_gpu_blocks,
            max_num_seqs=s.max_num_seqs,
            max_num_batched_tokens=s.max_num_batched_tokens,
            capabilities=self.capabilities,
        )

    @property
    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities(
            logprobs=True,
            max_top_logprobs=MAX_TOP_LOGPROBS,
            prompt_logprobs=True,
            min_p=True,
            repetition_penalty=True,
            presence_penalty=True,
            frequency_penalty=True,
            guided_decoding=self.constraint_factory is not None,
        )

    async def drain(self) -> None:
        self._closed = True
        self._fail_all(EngineShutdown("the pytorch engine is shutting down"))

    async def cleanup(self) -> None:
        """Stop the step thread and the publisher; end every open stream. Idempotent."""
        self._closed = True
        thread, self._thread = self._thread, None
        if thread is not None:
            await asyncio.to_thread(thread.stop)
        if self.transfer is not None:
            await self.transfer.close()
        publisher, self._publisher = self._publisher, None
        if publisher is not None:
            publisher.cancel()
            await asyncio.gather(publisher, return_exceptions=True)
        self._fail_all(EngineShutdown("the pytorch engine was cleaned up"))

    # -- requests ----------------------------------------------------------------------------
    async def generate(
        self, request: PreprocessedRequest, ctx: GenerateContext
    ) -> AsyncGenerator[LLMEngineOutput, None]:
        thread, loaded = self._thread, self.loaded
        if self._closed or thread is None or loaded is None:
            raise EngineShutdown("the pytorch engine is not running")
        key = f"{ctx.id}#{next(self._keys)}"
        constraint = None
        guided = request.sampling.guided_decoding
        if guided is not None:
            if self.constraint_factory is None:
                raise InvalidArgument("guided decoding is not supported by this engine")
            constraint = await self.constraint_factory(guided)
        handoff = request.prefill_result
        if handoff is not None and self.config.disaggregation_mode == "decode":
            await self._receive_prompt(request, handoff)
            request = msgspec.structs.replace(request, prefill_result=None)
        seq, sampler = self._build(request, key, ctx.id, constraint)
        if handoff is not None:  # report the prefill worker's prefix hit, not the transfer
            seq.num_cached_tokens = handoff.num_cached_tokens
        col = Collector(logprobs=sampler.params.logprobs is not None)
        self._collectors[key] = col
        self._ctx_keys.setdefault(ctx.id, set()).add(key)
        thread.submit(Add(seq, sampler))
        remove_monitor = ctx.on_stop(col.wake)
        loop = asyncio.get_running_loop()
        n_out = 0
        try:
            while True:
                if (col.cancelled or ctx.is_stopped()) and col.terminal is None:
                    out = col.take(FinishReason.CANCELLED)
                    n_out += len(out.token_ids)
                    out.usage = _usage(seq, n_out)
                    yield out
                    return
                if col.error is not None:
                    raise col.error
                if col.terminal is not None:
                    out = col.take(col.terminal)
                    out.usage = _usage(seq, seq.num_output_tokens)
                    if self.config.disaggregation_mode == "prefill":
                        out.disaggregated_params = self._handoff(seq)
                    yield out
                    return
                if col.has_tokens:
                    out = col.take(None)
                    n_out += len(out.token_ids)
                    yield out
                    continue
                col.waiter = loop.create_future()
                await col.waiter
                col.waiter = None
        finally:
            remove_monitor()
            self._forget(key, ctx.id)
            if not col.done:  # queued or running: free its blocks now, on any exit path
                thread.submit(Abort(key))

    def _build(
        self,
        request: PreprocessedRequest,
        key: str,
        ctx_id: str,
        constraint: TokenConstraint | None,
    ) -> tuple[Sequence, RequestSampler]:
        assert self.loaded is not None
        settings, vocab = self.loaded.settings, self.loaded.model.config.vocab_size
        if any(not 0 <= t < vocab for t in request.token_ids):
            raise InvalidArgument(f"token ids must be in [0, {vocab})")
        seq = sequence_from_request(
            settings, request, key, 0.0, seed_id=request.request_id or ctx_id
        )
        params = SamplingParams.from_request(request)
        sampler = RequestSampler(
            params=params,
            generator=make_generator(seq.rng_state, self.loaded.model.device),
            stop_token_ids=seq.stop_token_ids,
            constraint=constraint,
            prompt_logprobs=[None] if request.output.prompt_logprobs is not None else None,
        )
        return seq, sampler

    async def abort(self, ctx: Context) -> None:
        """Free the context's requests now; their streams end with a ``cancelled`` terminal."""
        thread = self._thread
        for key in list(self._ctx_keys.get(ctx.id, ())):
            col = self._collectors.get(key)
            if col is not None and not col.done:
                col.cancelled = True
                if thread is not None:
                    thread.submit(Abort(key))
                col.wake()

    def _forget(self, key: str, ctx_id: str) -> None:
        self._collectors.pop(key, None)
        keys = self._ctx_keys.get(ctx_id)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._ctx_keys[ctx_id]

    # -- disaggregation ----------------------------------------------------------------------------
    def _handoff(self, seq: Sequence) -> DisaggregatedParams:
        """What the decode worker needs: where the prompt's KV is, and which blocks."""
        n_full = seq.num_prompt_tokens // seq.block_size
        return DisaggregatedParams(
            prefill_worker_id=self.worker_id or 0,
            block_hashes=seq.block_hashes[:n_full],
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens or 0,
        )

    async def _receive_prompt(
        self, request: PreprocessedRequest, handoff: DisaggregatedParams
    ) -> None:
        """Pull the prompt's blocks from the prefill worker into this engine's prefix cache (not
        announced: routers index only what this worker computes). Runs on the event loop and
        the network while the step thread keeps stepping other requests; then the request is
        admitted as a local one whose prefix is cached. Blocks this engine already caches are
        not pulled; a prefill worker that evicted some gives a shorter run (the rest is computed
        here). A failed pull fails the request with ``KVTransferFailed`` (the prefill worker
        failed, not this one: a frontend with migration on prefills again); nothing is
        allocated before the bytes are in, so a failed pull holds no block."""
        if self.transfer is None:
            raise InvalidArgument("this decode worker has no KV transfer agent")
        try:
            await self._pull_prompt(request, handoff, self.transfer)
        except (CannotConnect, StreamIncomplete, Unknown) as exc:
            raise KVTransferFailed(
                f"KV of the prompt from prefill worker {handoff.prefill_worker_id:x}: {exc}"
            ) from exc

    async def _pull_prompt(
        self, request: PreprocessedRequest, handoff: DisaggregatedParams, agent: KVTransferAgent
    ) -> None:
        hashes = handoff.block_hashes
        loaded = self._require_loaded()
        peer_layout = (await agent.peer(handoff.prefill_worker_id)).layout
        start = 0  # another layout names its blocks differently: pull them all
        if peer_layout == msgspec.to_builtins(loaded.cache.layout):
            start = await self._call(lambda: self._scheduler().kv.num_cached_prefix(hashes))
            if start >= len(hashes):
                return  # a decode-side prefix hit covers the whole prompt
        received = await agent.pull(handoff.prefill_worker_id, hashes[start:])
        if not all(part.block_hashes for part in received):
            return
        parts = [
            KVBlocks(
                layout=msgspec.convert(part.layout, KVLayout),
                block_hashes=part.block_hashes,
                local_hashes=part.local_hashes,
                data=part.data,
            )
            for part in received
        ]
        tokens = request.token_ids

        def store() -> int:
            # The head shards of a split prefill pool are put side by side first (CPU work:
            # here on the step thread, not on the event loop). Should the cached lead be
            # evicted meanwhile, the prefix lookup stops there and the request computes the
            # rest: correct either way.
            try:
                blocks = parts[0] if len(parts) == 1 else merge_head_shards(parts)
            except ValueError as exc:  # the peer's shards do not fit together
                raise Unknown(f"KV head shards: {exc}") from exc
            return loaded.import_blocks(self._scheduler(), blocks, announce=False, token_ids=tokens)

        await self._call(store)

    # -- KV export / import (disaggregation) ---------------------------------------------------
    async def export_kv(self, block_hashes: list[int]) -> KVBlocks:
        """The K/V of the leading cached blocks of ``block_hashes`` (stops at the first block
        not cached: the result may be shorter)."""
        loaded = self._require_loaded()
        return await self._call(lambda: loaded.export_blocks(self._scheduler(), block_hashes))

    async def export_for_peer(self, block_hashes: list[int]) -> ExportedBlocks:
        """The transfer agent's export: the leading cached run of ``block_hashes``."""
        blocks = await self.export_kv(block_hashes)
        return ExportedBlocks(
            layout=msgspec.to_builtins(blocks.layout),
            block_hashes=blocks.block_hashes,
            local_hashes=blocks.local_hashes,
            data=blocks.data,
        )

    async def import_kv(self, blocks: KVBlocks) -> int:
        """Store exported blocks in this engine's prefix cache (announced with KV events, as
        computed blocks are). Returns how many were new. ``InvalidArgument`` on a layout
        mismatch or no room."""
        loaded = self._require_loaded()
        return await self._call(lambda: loaded.import_blocks(self._scheduler(), blocks))

    def _require_loaded(self) -> LoadedModel:
        if self.loaded is None or self._thread is None:
            raise EngineShutdown("the pytorch engine is not running")
        return self.loaded

    def _scheduler(self) -> Scheduler:
        assert self._thread is not None
        return self._thread.scheduler

    async def _call(self, fn: Callable[[], T]) -> T:
        thread, loop = self._thread, asyncio.get_running_loop()
        if thread is None:
            raise EngineShutdown("the pytorch engine is not running")
        future: asyncio.Future[T] = loop.create_future()

        def done(result: Any, error: BaseException | None) -> None:
            def settle() -> None:
                if future.done():
                    return
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(result)

            loop.call_soon_threadsafe(settle)

        thread.submit(Call(fn, done))
        return await future

    # -- reports from the step thread ------------------------------------------------------------
    def _report_threadsafe(self, report: StepReport) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._deliver, report)

    def _crash_threadsafe(self, exc: BaseException) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._on_crash)

    def _on_crash(self) -> None:
        self._closed = True
        self._fail_all(EngineShutdown("the pytorch engine's step loop crashed"))

    def _deliver(self, report: StepReport) -> None:
        collectors = self._collectors
        for item in report.outputs:
            col = collectors.get(item.request_id)
            if col is not None:
                if item.prompt_logprobs is not None:
                    col.prompt_logprobs = item.prompt_logprobs
                col.add(item.token, item.logprob, item.top)
        for seq in report.finished:
            col = collectors.get(seq.request_id)
            if col is not None:
                col.done = True
                col.terminal = seq.finish_reason or FinishReason.STOP
                col.wake()
        if report.events:
            self._outbox.put_nowait(
                KVEventBatch(worker_id=self.worker_id or 0, events=report.events)
            )
        if report.load is not None and report.load != self._last_load:
            self._last_load = report.load
            self._outbox.put_nowait(report.load)

    async def _publish_loop(self) -> None:
        while True:
            item = await self._outbox.get()
            try:
                if isinstance(item, KVEventBatch):
                    if self.kv_event_sink is not None:
                        await self.kv_event_sink(item)
                elif self.load_sink is not None:
                    await self.load_sink(item)
            except Exception:
                log.exception("publishing KV events / load failed")

    def _fail_all(self, error: DynamoError) -> None:
        for col in self._collectors.values():
            if col.terminal is None and col.error is None:
                col.error = error
                col.wake()

    # -- introspection (tests, metrics) ----------------------------------------------------------
    def metrics_snapshot(self) -> list[RankMetrics]:
        return rank_metrics(self)

    @property
    def stats(self) -> EngineStats | None:
        return self._thread.stats if self._thread is not None else None

    @property
    def scheduler(self) -> Scheduler | None:
        return self._thread.scheduler if self._thread is not None else None

    async def check_invariants(self) -> None:
        """Run the scheduler's invariant checks on the step thread (tests)."""
        await self._call(lambda: self._scheduler().check_invariants())


def _guided_factory(model_path: str, loaded: LoadedModel) -> ConstraintFactory | None:
    """llguidance matchers for the loaded model's tokenizer, or None (logged) when llguidance
    cannot read it. Blocking (tokenizer set-up): call it in a worker thread."""
    try:
        decoder = decoder_for_model(
            model_path, loaded.model.config.vocab_size, loaded.settings.max_model_len
        )
    except (ValueError, OSError) as exc:
        log.warning("guided decoding is off: %s", exc)
        return None
    return decoder.matcher_async


def _usage(seq: Sequence, completion_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=seq.num_prompt_tokens,
        completion_tokens=completion_tokens,
        cached_tokens=seq.num_cached_tokens,
    )
