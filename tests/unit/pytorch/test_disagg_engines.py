"""Two PyTorch engines in one process, prefill and decode, their transfer agents on loopback
(same KV layout): the decode engine pulls only the blocks it lacks, its output equals the
aggregated (transformers) output, its received blocks are never announced, and both pools are
back to zero blocks in use."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from dynamo.backend.kv_transfer import (
    AgentDescriptor,
    ExportedBlocks,
    KVTransferAgent,
    ShardAddress,
    publish_descriptor,
)
from dynamo.frontend.migration import is_instance_fault, is_migratable
from dynamo.protocol.kv_events import KVEventBatch
from dynamo.protocol.request import PreprocessedRequest, SamplingOptions, StopConditions
from dynamo.pytorch.config import TorchEngineConfig
from dynamo.pytorch.engine import TorchEngine
from dynamo.pytorch.kv_cache import KVBlocks, KVLayout
from dynamo.runtime.config import RuntimeConfig
from dynamo.runtime.context import Context
from dynamo.runtime.errors import KVTransferFailed
from dynamo.runtime.runtime import DistributedRuntime, InProcessHub
from tests.tiny_models import TEST_DEVICE, hf_greedy

RUNTIME = RuntimeConfig(discovery_backend="memory", request_plane="local", event_plane="local")


def engine_config(model: Path, mode: str) -> TorchEngineConfig:
    return TorchEngineConfig(
        model_path=str(model),
        block_size=16,
        num_gpu_blocks_override=64,
        disaggregation_mode=mode,
        device=TEST_DEVICE,
    )


def request(tokens: list[int], handoff: object = None, max_tokens: int = 6) -> PreprocessedRequest:
    return PreprocessedRequest(
        model="tiny",
        token_ids=tokens,
        sampling=SamplingOptions(temperature=0.0),
        stop=StopConditions(max_tokens=max_tokens, ignore_eos=True),
        prefill_result=handoff,  # type: ignore[arg-type]
    )


async def test_decode_engine_pulls_what_it_lacks_and_matches_aggregated(
    tiny_llama: Path,
) -> None:
    hub = InProcessHub()
    rt_p, rt_d = DistributedRuntime(RUNTIME, hub), DistributedRuntime(RUNTIME, hub)
    await rt_p.start()
    await rt_d.start()
    events: list[KVEventBatch] = []

    async def sink(batch: KVEventBatch) -> None:
        events.append(batch)

    def config(mode: str) -> TorchEngineConfig:
        return TorchEngineConfig(
            model_path=str(tiny_llama),
            block_size=16,
            num_gpu_blocks_override=64,
            disaggregation_mode=mode,
            device=TEST_DEVICE,
        )

    agent_p = KVTransferAgent(rt_p, None)
    agent_d = KVTransferAgent(rt_d, None)
    prefill = TorchEngine(config("prefill"), transfer=agent_p)
    agent_p.serve(prefill.export_for_peer)
    decode = TorchEngine(config("decode"), transfer=agent_d, kv_event_sink=sink)
    await prefill.start(0xA)
    await decode.start(0xB)
    try:
        base = list(range(20, 120))
        for n, prompt in enumerate((base[:70], base[:100], base[:90])):
            outs = [o async for o in prefill.generate(request(prompt), Context())]
            handoff = outs[-1].disaggregated_params
            assert handoff is not None and handoff.prefill_worker_id == 0xA
            assert sum(len(o.token_ids) for o in outs) == 1  # the prefill runs one token
            before = agent_d.stats.bytes_received
            got = [o async for o in decode.generate(request(prompt, handoff), Context())]
            assert [t for o in got for t in o.token_ids] == hf_greedy(tiny_llama, prompt, 6)
            pulled = agent_d.stats.bytes_received - before
            if n == 0:
                assert pulled > 0
            elif n == 1:  # shares 4 of its 6 blocks with the first prompt: 2 pulled
                assert 0 < pulled < agent_d.stats.bytes_received - pulled
            else:  # its 5 blocks are all cached on the decode side: nothing pulled
                assert pulled == 0
        await decode.check_invariants()
        assert decode.scheduler is not None and prefill.scheduler is not None
        assert decode.scheduler.kv.num_active_blocks == prefill.scheduler.kv.num_active_blocks == 0
        stored = [e for b in events for e in b.events if type(e.data).__name__ == "BlocksStored"]
        received = set(prefill.scheduler.kv.cached_blocks())
        for event in stored:  # only blocks the decode engine computed itself are announced
            assert not {b.block_hash for b in event.data.blocks} & received  # type: ignore[union-attr]
    finally:
        await decode.cleanup()
        await prefill.cleanup()
        await rt_d.shutdown()
        await rt_p.shutdown()


async def test_a_failed_pull_is_a_kv_transfer_failure_and_holds_no_block(
    tiny_llama: Path,
) -> None:
    """The prefill worker's agent is gone when the decode engine pulls: the request fails with
    ``KVTransferFailed`` (migratable, and not a fault of the decode worker) and the decode pool
    holds nothing."""
    hub = InProcessHub()
    rt_p, rt_d = DistributedRuntime(RUNTIME, hub), DistributedRuntime(RUNTIME, hub)
    await rt_p.start()
    await rt_d.start()
    agent_p, agent_d = KVTransferAgent(rt_p, None), KVTransferAgent(rt_d, None)
    prefill = TorchEngine(engine_config(tiny_llama, "prefill"), transfer=agent_p)
    agent_p.serve(prefill.export_for_peer)
    decode = TorchEngine(engine_config(tiny_llama, "decode"), transfer=agent_d)
    await prefill.start(0xA)
    await decode.start(0xB)
    try:
        prompt = list(range(30, 100))
        outs = [o async for o in prefill.generate(request(prompt), Context())]
        handoff = outs[-1].disaggregated_params
        await agent_d.peer(0xA)  # its descriptor is cached: the pull itself fails
        await agent_p.close()
        with pytest.raises(KVTransferFailed):
            async for _ in decode.generate(request(prompt, handoff), Context()):
                pass
        await decode.check_invariants()
        assert decode.scheduler is not None
        assert decode.scheduler.kv.num_active_blocks == 0
        assert not is_instance_fault(KVTransferFailed()) and is_migratable(KVTransferFailed())
    finally:
        await decode.cleanup()
        await prefill.cleanup()
        await rt_d.shutdown()
        await rt_p.shutdown()


def _head_shard(blocks: KVBlocks, start: int, stop: int) -> ExportedBlocks:
    """What one rank of a tensor-parallel prefill worker holding KV heads [start, stop) of the
    model would export: its heads of every (layer, K/V) section, in the wire's token-major
    order ``[tokens, heads, head_dim]``."""
    lay = blocks.layout
    tokens = len(blocks.block_hashes) * lay.block_size
    flat = torch.frombuffer(bytearray(blocks.data), dtype=torch.uint8).view(torch.float32)
    sections = flat.view(2 * lay.num_layers, tokens, lay.num_kv_heads, lay.head_dim)
    part = sections[:, :, start:stop].contiguous().view(torch.uint8).numpy().tobytes()
    layout = msgspec.structs.replace(
        lay, num_kv_heads=stop - start, head_start=start, total_kv_heads=lay.num_kv_heads
    )
    return ExportedBlocks(
        layout=msgspec.to_builtins(layout),
        block_hashes=blocks.block_hashes,
        local_hashes=blocks.local_hashes,
        data=part,
    )


async def test_decode_engine_merges_a_prefill_pool_split_in_head_shards(
    tiny_llama: Path,
) -> None:
    """A prefill worker whose KV heads are split over two ranks (as tensor parallelism splits
    them: here the heads of a real prefill engine's pool served by two agents, one per head
    range, behind one descriptor that lists both shards) and a decode engine holding all the
    heads: the decode engine pulls both shards, puts the heads side by side and its greedy
    output equals the aggregated one. What is real: the bytes, both transfers, the merge, the
    import and the decode; what is modelled: the split (our engine computes with TP=1)."""
    hub = InProcessHub()
    rt_p, rt_d = DistributedRuntime(RUNTIME, hub), DistributedRuntime(RUNTIME, hub)
    await rt_p.start()
    await rt_d.start()
    prefill = TorchEngine(engine_config(tiny_llama, "prefill"))
    agent_d = KVTransferAgent(rt_d, None)
    decode = TorchEngine(engine_config(tiny_llama, "decode"), transfer=agent_d)
    await prefill.start(0xA)
    await decode.start(0xB)
    assert prefill.loaded is not None
    whole = prefill.loaded.cache.layout
    heads = whole.num_kv_heads
    assert heads >= 2
    ranges = [(0, heads // 2), (heads // 2, heads)]
    ranks: list[KVTransferAgent] = []
    try:
        for n, (start, stop) in enumerate(ranges):

            async def export(
                hashes: list[int], start: int = start, stop: int = stop
            ) -> ExportedBlocks:
                return _head_shard(await prefill.export_kv(hashes), start, stop)

            rank = KVTransferAgent(rt_p, export)
            await rank.start(0xA0 + n, {}, 0)
            ranks.append(rank)
        shards = [
            ShardAddress(
                host="127.0.0.1", port=rank.port, layout=_head_shard_layout(whole, start, stop)
            )
            for rank, (start, stop) in zip(ranks, ranges, strict=True)
        ]
        await publish_descriptor(
            rt_p,
            0xA,
            AgentDescriptor(
                host="127.0.0.1", port=0, layout=msgspec.to_builtins(whole), shards=shards
            ),
        )
        prompt = list(range(40, 110))
        outs = [o async for o in prefill.generate(request(prompt), Context())]
        handoff = outs[-1].disaggregated_params
        got = [o async for o in decode.generate(request(prompt, handoff), Context())]
        assert [t for o in got for t in o.token_ids] == hf_greedy(tiny_llama, prompt, 6)
        assert [r.stats.pulls_served for r in ranks] == [1, 1]
        per_rank = [r.stats.bytes_sent for r in ranks]
        assert per_rank[0] > 0 and sum(per_rank) == agent_d.stats.bytes_received
        await decode.check_invariants()
        assert decode.scheduler is not None and decode.scheduler.kv.num_active_blocks == 0
    finally:
        for rank in ranks:
            await rank.close()
        await decode.cleanup()
        await prefill.cleanup()
        await rt_d.shutdown()
        await rt_p.shutdown()


def _head_shard_layout(whole: KVLayout, start: int, stop: int) -> dict[str, object]:
    layout = msgspec.structs.replace(
        whole, num_kv_heads=stop - start, head_start=start, total_kv_heads=whole.num_kv_heads
    )
    return msgspec.to_builtins(layout)  # type: ignore[no-any-return]
