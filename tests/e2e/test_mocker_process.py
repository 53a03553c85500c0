"""``python -m dynamo.mocker`` in a subprocess serves streams over the TCP request plane."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import msgspec
import pytest

from dynamo.protocol.load import LOAD_TOPIC, WorkerLoad
from dynamo.protocol.output import FinishReason, LLMEngineOutput
from dynamo.protocol.request import PreprocessedRequest, StopConditions
from dynamo.runtime.context import Context
from dynamo.runtime.naming import EndpointId
from dynamo.runtime.runtime import DistributedRuntime

pytestmark = pytest.mark.e2e
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(LLMEngineOutput)


async def test_mocker_serves_streams_and_caches_prefixes(
    spawn: Any, runtime: DistributedRuntime
) -> None:
    proc = spawn(
        [
            "-m",
            "dynamo.mocker",
            "--model-path",
            "dynamo/models/demo",
            "--model-name",
            "demo",
            "--speedup-ratio",
            "0",
            "--block-size",
            "16",
            "--num-workers",
            "2",
        ]
    )
    loads = await runtime.events.subscribe(LOAD_TOPIC)
    client = await runtime.client(EndpointId("dynamo", "backend", "generate"))
    await client.wait_for_instances(2, timeout=20)
    iid, other = client.instance_ids()
    prompt = list(range(10, 170))  # 160 tokens = 10 blocks of 16

    async def run(instance: int = iid) -> list[LLMEngineOutput]:
        body = _enc.encode(
            PreprocessedRequest(model="demo", token_ids=prompt, stop=StopConditions(max_tokens=8))
        )
        stream = client.stream(body, Context(), instance_id=instance)
        return [_dec.decode(raw) async for raw in stream]

    first = await run()
    assert sum(len(o.token_ids) for o in first) == 8
    assert first[-1].finish_reason is FinishReason.LENGTH
    assert first[-1].usage is not None and first[-1].usage.cached_tokens == 0
    second = await run()
    assert second[-1].usage is not None and second[-1].usage.cached_tokens == 159  # all but one
    # the other engine of the process (--num-workers 2) has its own, empty cache
    elsewhere = await run(other)
    assert elsewhere[-1].usage is not None and elsewhere[-1].usage.cached_tokens == 0
    # Load metrics arrive on the event plane; after a request nothing is running. (The first
    # messages can precede our subscription's connection: ZMQ's slow joiner; so retry.)
    seen = None
    for _ in range(5):
        await run()
        try:
            async with asyncio.timeout(3):
                async for message in loads:
                    load = msgspec.msgpack.decode(message.payload, type=WorkerLoad)
                    if load.worker_id == iid and load.num_running == 0 and load.total_blocks:
                        seen = load
                        break
        except TimeoutError:
            continue
        if seen is not None:
            break
    assert seen is not None and seen.active_decode_blocks == 0
    await loads.close()
    proc.popen.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(proc.popen.wait, 15) == 0
