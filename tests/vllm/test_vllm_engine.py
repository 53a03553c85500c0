"""``VllmEngine`` (vLLM's AsyncLLM in process) on a tiny random Llama built at test time: the
conformance kit, greedy output equal to transformers', cancellation (vLLM's blocks freed), guided
choice, and KV events bridged with our block hashes: the router's view built from them predicts
vLLM's own prefix-cache hits through evictions. One engine per module (a vLLM start takes
30-70 s)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from dynamo.backend.testing import check_engine
from dynamo.protocol.kv_events import AllBlocksCleared, BlocksRemoved, BlocksStored, KVEventBatch
from dynamo.protocol.output import FinishReason, LLMEngineOutput
from dynamo.protocol.request import (
    GuidedDecodingOptions,
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
)
from dynamo.router.hashing import local_block_hashes, sequence_hashes
from dynamo.runtime.context import Context
from dynamo.vllm.engine import VllmEngine
from tests.tiny_models import build, hf_greedy

pytestmark = pytest.mark.asyncio(loop_scope="module")  # one engine for the module's tests
BS = 32  # vLLM's CPU attention needs a multiple of 32
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("llama_hd64", tmp_path_factory.getbasetemp())


NUM_BLOCKS = 24  # small, so that the view test evicts


def engine_args(model: Path, **overrides: Any) -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs(
        model=str(model),
        dtype="float32",
        block_size=BS,
        max_model_len=512,
        max_num_seqs=16,
        max_num_batched_tokens=512,
        enable_prefix_caching=True,
        enforce_eager=True,  # no torch.compile: start-up in seconds, not minutes, on CPU
        **overrides,
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(model_dir: Path) -> AsyncIterator[tuple[VllmEngine, list[KVEventBatch]]]:
    batches: list[KVEventBatch] = []

    async def sink(batch: KVEventBatch) -> None:
        batches.append(batch)

    eng = VllmEngine(engine_args(model_dir, num_gpu_blocks_override=NUM_BLOCKS), kv_event_sink=sink)
    await eng.start(5)
    yield eng, batches
    await eng.cleanup()


def request_for(tokens: list[int], max_tokens: int = 6, **sampling: Any) -> PreprocessedRequest:
    return PreprocessedRequest(
        model="tiny",
        token_ids=tokens,
        sampling=SamplingOptions(**sampling),
        stop=StopConditions(max_tokens=max_tokens, ignore_eos=True),
    )


async def run(eng: VllmEngine, req: PreprocessedRequest) -> list[LLMEngineOutput]:
    return [out async for out in eng.generate(req, Context())]


def ids(chunks: list[LLMEngineOutput]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


async def test_conformance_kit(model_dir: Path) -> None:
    report = await check_engine(lambda: VllmEngine(engine_args(model_dir)))
    assert report.ok, report.failures


PROMPTS = [[(i * 7 + j) % 380 + 5 for j in range(70 + 9 * i)] for i in range(4)]


async def test_greedy_matches_transformers(
    engine: tuple[VllmEngine, list[KVEventBatch]], model_dir: Path
) -> None:
    eng, _ = engine
    outs = await asyncio.gather(*(run(eng, request_for(p, 8, greedy=True)) for p in PROMPTS))
    for p, out in zip(PROMPTS, outs, strict=True):
        assert ids(out) == hf_greedy(model_dir, p, 8)
        assert out[-1].finish_reason is FinishReason.LENGTH
        assert out[-1].usage is not None and out[-1].usage.completion_tokens == 8


async def test_kv_events_carry_our_hashes(
    engine: tuple[VllmEngine, list[KVEventBatch]],
) -> None:
    eng, batches = engine
    prompts = PROMPTS
    await asyncio.gather(*(run(eng, request_for(p, 2, greedy=True)) for p in prompts))
    stored: set[int] = set()
    for _ in range(100):
        stored = {
            b.tokens_hash
            for batch in batches
            for e in batch.events
            if isinstance(e.data, BlocksStored)
            for b in e.data.blocks
        }
        if all(set(local_block_hashes(p, BS)) <= stored for p in prompts):
            break
        await asyncio.sleep(0.05)
    for p in prompts:
        assert set(local_block_hashes(p, BS)) <= stored
    assert all(batch.worker_id == 5 for batch in batches)
    # A repeated prompt is a prefix-cache hit in vLLM.
    again = await run(eng, request_for(prompts[3], 2, greedy=True))
    assert again[-1].usage is not None
    assert again[-1].usage.cached_tokens == len(prompts[3]) // BS * BS


async def test_cancellation_aborts_and_frees_vllm_blocks(
    engine: tuple[VllmEngine, list[KVEventBatch]],
) -> None:
    eng, batches = engine
    ctx = Context()
    chunks: list[LLMEngineOutput] = []
    async for out in eng.generate(request_for(list(range(5, 40)), 200, temperature=1.0), ctx):
        chunks.append(out)
        if len(ids(chunks)) >= 2:
            ctx.stop_generating()
    assert chunks[-1].finish_reason is FinishReason.CANCELLED
    assert len(ids(chunks)) < 200
    # vLLM's request is aborted and its blocks freed: the scheduler reports nothing running, and
    # the prefix cache can be reset (vLLM refuses while any block is in use).
    llm: Any = eng._llm
    for _ in range(200):
        if eng.metrics_snapshot()[0].num_running == 0 and await llm.reset_prefix_cache():
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError(f"vLLM still holds the cancelled request: {eng.metrics_snapshot()}")
    out = await run(eng, request_for(list(range(5, 40)), 3, greedy=True))
    assert len(ids(out)) == 3
    # The reset reached the router's view as a "cleared" event, then the new request's block
    # (waited for, not assumed after a quiet spell: events cross a ZMQ socket at a step's end).
    assert eng.bridge is not None
    expected = set(sequence_hashes(local_block_hashes(list(range(5, 40)), BS)))
    for _ in range(400):
        cleared = any(isinstance(e.data, AllBlocksCleared) for b in batches for e in b.events)
        if cleared and eng.bridge.stored_hashes() == expected:
            break
        await asyncio.sleep(0.05)
    assert any(isinstance(e.data, AllBlocksCleared) for b in batches for e in b.events)
    assert eng.bridge.stored_hashes() == expected


async def test_scheduler_gauges_are_the_only_prometheus_logger(
    engine: tuple[VllmEngine, list[KVEventBatch]],
) -> None:
    """Our gauges see vLLM's scheduler reports (a running request, its blocks), and vLLM adds
    no Prometheus logger of its own (its per-step metrics would go unserved)."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    eng, _ = engine
    llm: Any = eng._llm
    prometheus = [
        lg for lg in llm.logger_manager.stat_loggers if isinstance(lg, PrometheusStatLogger)
    ]
    assert len(prometheus) == 1 and type(prometheus[0]) is not PrometheusStatLogger
    seen: list[Any] = []
    async for out in eng.generate(request_for(list(range(7, 50)), 4, greedy=True), Context()):
        if out.finish_reason is None:
            seen.append(eng.metrics_snapshot()[0])
    assert seen and all(m.num_running == 1 and m.kv_used_blocks >= 1 for m in seen), seen


async def settled(batches: list[KVEventBatch]) -> None:
    """Until no KV event batch has arrived for 0.5 s (vLLM publishes each step's events at the
    end of the step; they cross a ZMQ socket)."""
    seen = -1
    for _ in range(100):
        await asyncio.sleep(0.5)
        if len(batches) == seen:
            return
        seen = len(batches)


async def test_router_view_predicts_vllm_prefix_hits_through_evictions(
    engine: tuple[VllmEngine, list[KVEventBatch]],
) -> None:
    """More distinct prompts than the cache holds: vLLM evicts, the bridge relays the removals,
    and for every prompt the overlap the router would compute from the bridged view equals the
    prefix-cache hit vLLM reports when the prompt is sent again."""
    eng, batches = engine
    assert eng.bridge is not None
    prompts = [[(i * 131 + j * 7) % 380 + 5 for j in range(100)] for i in range(10)]  # 3 blocks
    for p in prompts:
        await run(eng, request_for(p, 2, greedy=True))
    await settled(batches)
    assert eng.bridge.num_blocks <= NUM_BLOCKS - 1  # vLLM's null block is never cached
    assert any(isinstance(e.data, BlocksRemoved) for b in batches for e in b.events)
    hits = []
    for p in reversed(prompts):
        view = eng.bridge.stored_hashes()
        predicted = 0
        for h in sequence_hashes(local_block_hashes(p, BS)):
            if h not in view:
                break
            predicted += 1
        out = await run(eng, request_for(p, 2, greedy=True))
        assert out[-1].usage is not None
        assert out[-1].usage.cached_tokens == predicted * BS, (predicted, out[-1].usage)
        hits.append(predicted)
        await settled(batches)
    assert 0 < sum(hits) < 3 * len(prompts), hits  # some prompts were kept, some evicted


async def test_guided_choice_and_seeded_sampling(
    engine: tuple[VllmEngine, list[KVEventBatch]], model_dir: Path
) -> None:
    from dynamo.preprocess import load_model_dir

    eng, _ = engine
    tokenizer = load_model_dir(model_dir).tokenizer
    choices = ["Paris", "the lazy dog"]
    req = request_for(list(range(5, 30)), 20, temperature=1.0, seed=1)
    req.sampling.guided_decoding = GuidedDecodingOptions(choice=choices)
    req.stop.ignore_eos = False
    out = await run(eng, req)
    assert tokenizer.decode(ids(out)) in choices
    a = await run(eng, request_for(list(range(5, 30)), 6, temperature=1.0, seed=7))
    b = await run(eng, request_for(list(range(5, 30)), 6, temperature=1.0, seed=7))
    assert ids(a) == ids(b)
