"""Two PyTorch engines in one process, prefill and decode, their transfer agents on loopback
(same KV layout): the decode engine pulls only the blocks it lacks, its output equals the
aggregated (transformers) output, its received blocks are never announced, and both pools are
back to zero blocks in use."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynamo.backend.kv_transfer import KVTransferAgent
from dynamo.frontend.migration import is_instance_fault, is_migratable
from dynamo.protocol.kv_events import KVEventBatch
from dynamo.protocol.request import PreprocessedRequest, SamplingOptions, StopConditions
from dynamo.pytorch.config import TorchEngineConfig
from dynamo.pytorch.engine import TorchEngine
from dynamo.runtime.config import RuntimeConfig
from dynamo.runtime.context import Context
from dynamo.runtime.errors import KVTransferFailed
from dynamo.runtime.runtime import DistributedRuntime, InProcessHub
from tests.tiny_models import hf_greedy

RUNTIME = RuntimeConfig(discovery_backend="memory", request_plane="local", event_plane="local")


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
    settings = {"model_path": str(tiny_llama), "block_size": 16, "num_gpu_blocks_override": 64}
    agent_p, agent_d = KVTransferAgent(rt_p, None), KVTransferAgent(rt_d, None)
    prefill = TorchEngine(
        TorchEngineConfig(**settings, disaggregation_mode="prefill"), transfer=agent_p
    )  # type: ignore[arg-type]
    agent_p.serve(prefill.export_for_peer)
    decode = TorchEngine(
        TorchEngineConfig(**settings, disaggregation_mode="decode"), transfer=agent_d
    )  # type: ignore[arg-type]
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
