"""``VllmEngine``: vLLM's ``AsyncLLM`` in this process behind ``LLMEngine`` (spec 000).

vLLM runs its engine core in a child process of its own; this adapter maps our requests onto
``SamplingParams`` (``sampling.py``), streams deltas (token ids only: stop strings are the
frontend's), aborts vLLM's request when a stream ends early for any reason (its blocks are freed
at once), and bridges vLLM's ZMQ KV events into our event plane with our block hashes
(``kv_bridge.py``) so KV routing works on vLLM workers as on ours.

Disaggregation (``role`` prefill or decode): vLLM's KV-connector API with our connector
(``connector.py``, set as vLLM's ``kv_transfer_config``). A prefill engine asks vLLM to hand each
prompt off (``do_remote_decode``) and returns vLLM's handoff params as the terminal's
``disaggregated_params.engine_specific``; a decode engine passes a request's ``prefill_result``
back to vLLM (``do_remote_prefill``), whose connector pulls the prompt's KV from the prefill
worker before the request is scheduled. A failed pull fails the request with ``KVTransferFailed``.

vLLM is imported only here and in ``__main__`` (the ``vllm`` extra).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from dynamo.backend.engine import EngineConfig, GenerateContext, LLMEngine, RankMetrics
from dynamo.protocol.disagg import DisaggregatedParams
from dynamo.protocol.kv_events import KVEventBatch
from dynamo.protocol.model_card import EngineCapabilities, WorkerRole
from dynamo.protocol.output import FinishReason, LLMEngineOutput, TopLogprob, Usage
from dynamo.protocol.request import PreprocessedRequest
from dynamo.runtime.context import Context
from dynamo.runtime.errors import EngineShutdown, InvalidArgument, KVTransferFailed
from dynamo.vllm.kv_bridge import KVEventBridge, decode_batch
from dynamo.vllm.sampling import MAX_LOGPROBS, sampling_kwargs
from dynamo.vllm.stats import SchedulerGauges

log = logging.getLogger(__name__)

KVEventSink = Callable[[KVEventBatch], Awaitable[None]]

_FINISH = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.CANCELLED,
}


class VllmEngine(LLMEngine):
    """``engine_args``: vLLM's ``AsyncEngineArgs`` (its own flags, parsed by ``__main__``).
    With a ``kv_event_sink``, the engine binds a SUB socket on 127.0.0.1 (a free port) and sets
    vLLM's ``kv_events_config`` so that its publisher connects there (a bound port: no race for
    a free one); without a sink vLLM publishes no KV events. ``role``: aggregated, or a
    prefill / decode worker whose KV moves through our connector's agent listening on
    ``kv_transfer_host`` (a free port); ``engine_args`` then must not name a connector."""

    def __init__(
        self,
        engine_args: Any,
        *,
        served_model_name: str | None = None,
        kv_event_sink: KVEventSink | None = None,
        role: WorkerRole = WorkerRole.AGGREGATED,
        kv_transfer_host: str = "127.0.0.1",
    ) -> None:
        self.engine_args = engine_args
        self.served_model_name = served_model_name
        self.kv_event_sink = kv_event_sink
        self.role = role
        self.kv_transfer_host = kv_transfer_host
        self.handoffs = 0
        self._sub: Any = None
        self.worker_id: int | None = None
        self.bridge: KVEventBridge | None = None
        self._llm: Any = None
        self._context_length = 0
        self._keys = itertools.count()
        self._live: dict[str, set[str]] = {}
        self._events_task: asyncio.Task[None] | None = None
        self._closed = False
        self._gauges = SchedulerGauges()
        self._total_blocks = 0

    async def start(self, worker_id: int) -> EngineConfig:
        from vllm.v1.engine.async_llm import AsyncLLM

        if self._llm is not None:
            raise RuntimeError("VllmEngine.start() called twice")
        self.worker_id = worker_id
        args = self.engine_args
        if self.kv_event_sink is not None:
            import zmq
            import zmq.asyncio
            from vllm.config import KVEventsConfig

            sub = self._sub = zmq.asyncio.Context.instance().socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.bind("tcp://127.0.0.1:0")
            args.kv_events_config = KVEventsConfig(
                enable_kv_cache_events=True,
                publisher="zmq",
                endpoint=sub.getsockopt_string(zmq.LAST_ENDPOINT),  # vLLM connects to it
                topic="",
            )
        if self.role is not WorkerRole.AGGREGATED:
            args.kv_transfer_config = connector_config(self.role, self.kv_transfer_host)
        # Builds the engine core process and loads the model: seconds to a minute, blocking.
        self._llm = await asyncio.to_thread(
            AsyncLLM.from_engine_args, args, stat_loggers=[self._gauges.logger_factory()]
        )
        vconfig = self._llm.vllm_config
        self._context_length = int(vconfig.model_config.max_model_len)
        block_size = int(vconfig.cache_config.block_size)
        if self._sub is not None:
            self.bridge = KVEventBridge(block_size)
            self._events_task = asyncio.create_task(self._relay_kv_events(), name="vllm-kv")
        num_blocks = vconfig.cache_config.num_gpu_blocks
        self._total_blocks = int(num_blocks or 0)
        sched = vconfig.scheduler_config
        return EngineConfig(
            model=str(vconfig.model_config.model),
            served_model_name=self.served_model_name,
            context_length=self._context_length,
            kv_block_size=block_size,
            total_kv_blocks=int(num_blocks) if num_blocks else None,
            max_num_seqs=int(sched.max_num_seqs),
            max_num_batched_tokens=int(sched.max_num_batched_tokens),
            capabilities=EngineCapabilities(
                logprobs=True,
                max_top_logprobs=MAX_LOGPROBS,
                prompt_logprobs=True,
                min_p=True,
                repetition_penalty=True,
                presence_penalty=True,
                frequency_penalty=True,
                guided_decoding=True,
            ),
            kv_events=self.kv_event_sink is not None,
        )

    async def generate(
        self, request: PreprocessedRequest, ctx: GenerateContext
    ) -> AsyncGenerator[LLMEngineOutput, None]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        llm = self._llm
        if self._closed or llm is None:
            raise EngineShutdown("the vLLM engine is not running")
        kwargs = sampling_kwargs(request, self._context_length)
        structured = kwargs.pop("structured_outputs", None)
        handoff = request.prefill_result if self.role is WorkerRole.DECODE else None
        transfer = self._transfer_params(handoff)
        try:
            params = SamplingParams(
                **kwargs,
                extra_args=None if transfer is None else {"kv_transfer_params": transfer},
                output_kind=RequestOutputKind.DELTA,
                structured_outputs=None
                if structured is None
                else StructuredOutputsParams(**structured),
            )
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from exc
        key = f"{ctx.id}#{next(self._keys)}"
        self._live.setdefault(ctx.id, set()).add(key)
        prompt = TokensPrompt(prompt_token_ids=list(request.token_ids))
        n_out = 0
        finished = False
        try:
            stream = llm.generate(prompt, params, key)
            async for out in stream:
                if ctx.is_stopped():
                    break
                completion = out.outputs[0]
                chunk = LLMEngineOutput(token_ids=list(completion.token_ids))
                n_out += len(chunk.token_ids)
                if request.output.logprobs is not None and completion.logprobs:
                    _add_logprobs(chunk, completion.logprobs, request.output.logprobs)
                if out.prompt_logprobs is not None and n_out == len(chunk.token_ids):
                    chunk.prompt_logprobs = _prompt_logprobs(out.prompt_logprobs, request.token_ids)
                if out.finished:
                    finished = True
                    reason = str(completion.finish_reason)
                    if handoff is not None and reason == "error":
                        raise KVTransferFailed(
                            f"vLLM could not load the prompt's KV from prefill worker "
                            f"{handoff.prefill_worker_id:x}"
                        )
                    chunk.finish_reason = _FINISH.get(reason, FinishReason.STOP)
                    chunk.usage = Usage(
                        prompt_tokens=len(request.token_ids),
                        completion_tokens=n_out,
                        # a decode worker reports the prefill worker's prefix hit
                        cached_tokens=out.num_cached_tokens
                        if handoff is None
                        else handoff.num_cached_tokens,
                    )
                    if self.role is WorkerRole.PREFILL:
                        chunk.disaggregated_params = self._handoff(request, out)
                    if handoff is not None or chunk.disaggregated_params is not None:
                        self.handoffs += 1
                    yield chunk
                    return
                if chunk.token_ids:
                    yield chunk
            if not finished:  # stopped by the caller: vLLM's request is aborted below
                yield LLMEngineOutput(
                    finish_reason=FinishReason.CANCELLED,
                    usage=Usage(prompt_tokens=len(request.token_ids), completion_tokens=n_out),
                )
        except ValueError as exc:  # vLLM's validation of the prompt / params
            raise InvalidArgument(str(exc)) from exc
        finally:
            keys = self._live.get(ctx.id)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._live[ctx.id]
            if not finished:
                with contextlib.suppress(Exception):
                    await llm.abort(key)

    def _transfer_params(self, handoff: DisaggregatedParams | None) -> dict[str, Any] | None:
        """vLLM's ``kv_transfer_params`` for a request: a prefill engine hands every prompt
        off; a decode engine resumes from the prefill worker's params."""
        if self.role is WorkerRole.PREFILL:
            return {"do_remote_decode": True}
        if handoff is None:
            return None
        params = handoff.engine_specific
        if not params or not _HANDOFF_KEYS <= params.keys():
            raise KVTransferFailed(
                f"the handoff of prefill worker {handoff.prefill_worker_id:x} has no vLLM KV "
                "params (is it a vLLM prefill worker?)"
            )
        return {**params, "do_remote_prefill": True}

    def _handoff(self, request: PreprocessedRequest, out: Any) -> DisaggregatedParams | None:
        """The terminal's handoff: vLLM's params for the decode side (None: vLLM kept no blocks,
        e.g. the request stopped before its length; the decode side then computes the prompt)."""
        params = out.kv_transfer_params
        if not params:
            return None
        return DisaggregatedParams(
            prefill_worker_id=self.worker_id or 0,
            num_prompt_tokens=len(request.token_ids),
            num_cached_tokens=out.num_cached_tokens or 0,
            bootstrap_host=str(params["remote_host"]),
            bootstrap_port=int(params["remote_port"]),
            engine_specific=dict(params),
        )

    async def abort(self, ctx: Context) -> None:
        llm = self._llm
        keys = list(self._live.get(ctx.id, ()))
        if llm is not None and keys:
            await llm.abort(keys)

    def metrics_snapshot(self) -> list[RankMetrics]:
        """vLLM's last scheduler report (running, waiting, KV usage, prefix-cache hit rate)."""
        if self._llm is None:
            return []
        disagg = self.role is not WorkerRole.AGGREGATED
        return self._gauges.snapshot(self._total_blocks, self.handoffs if disagg else None)

    async def drain(self) -> None:
        self._closed = True

    async def cleanup(self) -> None:
        """Stop the KV relay and vLLM's engine core. Idempotent."""
        self._closed = True
        task, self._events_task = self._events_task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self._sub is not None:  # bound, but the relay never started
            self._sub.close(linger=0)
            self._sub = None
        llm, self._llm = self._llm, None
        if llm is not None:
            await asyncio.to_thread(llm.shutdown)

    async def _relay_kv_events(self) -> None:
        """vLLM's PUB socket -> our event plane, batch by batch, in order. A batch that cannot
        be decoded or converted is logged and skipped (the relay never dies on one); a gap in
        vLLM's sequence numbers (events the PUB socket dropped) is logged."""
        sub = self._sub
        assert self.bridge is not None and self.kv_event_sink is not None and sub is not None
        expected_seq: int | None = None
        try:
            while True:
                frames = await sub.recv_multipart()
                if len(frames) >= 3 and len(frames[-2]) == 8:
                    seq = int.from_bytes(frames[-2], "big")
                    if expected_seq is not None and seq != expected_seq:
                        log.warning("vLLM KV events %d..%d lost", expected_seq, seq - 1)
                    expected_seq = seq + 1
                try:
                    _, events, dp_rank = decode_batch(frames[-1])
                    converted = self.bridge.convert(events, dp_rank or 0)
                except Exception as exc:  # noqa: BLE001 - one bad batch must not end the relay
                    log.warning("undecodable vLLM KV event batch: %s", exc)
                    continue
                if converted:
                    await self.kv_event_sink(
                        KVEventBatch(worker_id=self.worker_id or 0, events=converted)
                    )
        finally:
            sub.close(linger=0)
            self._sub = None


_HANDOFF_KEYS = {"remote_host", "remote_port", "remote_handle", "remote_block_ids"}


def connector_config(role: WorkerRole, host: str) -> Any:
    """vLLM's ``KVTransferConfig`` for our connector in ``role``. A load that fails fails its
    request (``kv_load_failure_policy`` fail), never a silent local prefill."""
    from vllm.config import KVTransferConfig

    from dynamo.vllm.connector import CONNECTOR_NAME

    return KVTransferConfig(
        kv_connector=CONNECTOR_NAME,
        kv_connector_module_path="dynamo.vllm.connector",
        kv_role="kv_producer" if role is WorkerRole.PREFILL else "kv_consumer",
        kv_load_failure_policy="fail",
        kv_connector_extra_config={"host": host},
    )


def _add_logprobs(chunk: LLMEngineOutput, positions: list[dict[int, Any]], top: int) -> None:
    """vLLM's per-token ``{token_id: Logprob(logprob, rank)}`` (the sampled token plus the
    ``top`` most likely) -> our chosen log-probability and top-``top`` list."""
    chosen: list[float] = []
    tops: list[list[TopLogprob]] = []
    for token, entries in zip(chunk.token_ids, positions, strict=False):
        chosen.append(float(entries[token].logprob))
        ranked = sorted(
            ((t, e) for t, e in entries.items() if e.rank is not None and 0 < e.rank <= top),
            key=lambda item: item[1].rank,
        )
        tops.append([TopLogprob(t, float(e.logprob)) for t, e in ranked])
    chunk.log_probs, chunk.top_logprobs = chosen, tops


def _prompt_logprobs(positions: list[Any], prompt: list[int]) -> list[float | None]:
    out: list[float | None] = []
    for token, entries in zip(prompt, positions, strict=False):
        out.append(None if entries is None else float(entries[token].logprob))
    return out
