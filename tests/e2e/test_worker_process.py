"""A worker in a subprocess, a client in the test, over the TCP request plane (issue 2)."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest

from dynamo.protocol.output import FinishReason, LLMEngineOutput
from dynamo.protocol.request import PreprocessedRequest, StopConditions
from dynamo.runtime.client import EndpointClient
from dynamo.runtime.config import RuntimeConfig
from dynamo.runtime.context import Context
from dynamo.runtime.errors import Disconnected, InvalidArgument, NoInstances, StreamIncomplete
from dynamo.runtime.naming import EndpointId
from dynamo.runtime.runtime import DistributedRuntime

pytestmark = pytest.mark.e2e

HELPER = "tests/e2e/helpers/counting_worker.py"
ENDPOINT = EndpointId("dynamo", "backend", "generate")
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(LLMEngineOutput)


def body(first_token: int = 1, max_tokens: int = 8) -> bytes:
    return _enc.encode(
        PreprocessedRequest(
            model="test-model",
            token_ids=[first_token, 2, 3],
            stop=StopConditions(max_tokens=max_tokens),
        )
    )


async def outputs(stream: AsyncIterator[bytes]) -> list[LLMEngineOutput]:
    return [_dec.decode(raw) async for raw in stream]


@pytest.fixture
async def client_runtime(discovery_dir: str) -> AsyncIterator[DistributedRuntime]:
    rt = DistributedRuntime(
        RuntimeConfig(discovery_backend="file", discovery_dir=discovery_dir, lease_ttl=2)
    )
    await rt.start()
    yield rt
    await rt.shutdown()


async def start_workers(
    spawn: Callable[..., Any], runtime: DistributedRuntime, n: int = 1, **env: str
) -> tuple[list[Any], EndpointClient]:
    procs = [spawn([HELPER], **env) for _ in range(n)]
    for p in procs:
        await asyncio.to_thread(p.wait_for_line, "READY")
    client = await runtime.client(ENDPOINT)
    await client.wait_for_instances(n, timeout=10)
    return procs, client


async def test_stream_complete_and_typed_errors(
    spawn: Any, client_runtime: DistributedRuntime
) -> None:
    _, client = await start_workers(spawn, client_runtime)
    outs = await outputs(
        client.stream(body(max_tokens=8), Context(), instance_id=client.instance_ids()[0])
    )
    assert [t for o in outs for t in o.token_ids] == list(range(8))
    assert outs[-1].finish_reason is FinishReason.LENGTH
    with pytest.raises(InvalidArgument, match="666"):
        await outputs(
            client.stream(body(first_token=666), Context(), instance_id=client.instance_ids()[0])
        )
    outs = await outputs(
        client.stream(body(first_token=667), Context(), instance_id=client.instance_ids()[0])
    )
    assert outs[-1].finish_reason is FinishReason.ERROR and outs[-1].error == "engine exploded"


async def test_cancel_mid_stream_aborts_engine(
    spawn: Any, client_runtime: DistributedRuntime
) -> None:
    procs, client = await start_workers(spawn, client_runtime, TOKEN_DELAY="0.01")
    ctx = Context("cancel-me")
    received: list[LLMEngineOutput] = []
    stream = client.stream(body(max_tokens=100_000), ctx, instance_id=client.instance_ids()[0])
    async for raw in stream:
        received.append(_dec.decode(raw))
        if len(received) == 5:
            t0 = time.monotonic()
            ctx.stop_generating()
    elapsed = time.monotonic() - t0
    assert received[-1].finish_reason is FinishReason.CANCELLED
    assert elapsed < 5.0, elapsed  # prompt, not the stream's 1,000 s (generous: a loaded CI)
    await asyncio.to_thread(procs[0].wait_for_line, "ABORT cancel-me", 5)


async def test_sigkill_mid_stream_is_incomplete(
    spawn: Any, client_runtime: DistributedRuntime
) -> None:
    procs, client = await start_workers(spawn, client_runtime, TOKEN_DELAY="0.01")
    stream = client.stream(
        body(max_tokens=100_000), Context(), instance_id=client.instance_ids()[0]
    )
    t0 = 0.0
    with pytest.raises((StreamIncomplete, Disconnected)):
        n = 0
        async for _ in stream:
            n += 1
            if n == 3:
                procs[0].popen.send_signal(signal.SIGKILL)
                t0 = time.monotonic()
    assert time.monotonic() - t0 < 5.0  # at once, not a hang (generous: a loaded CI)


async def test_sigterm_shutdown_order(spawn: Any, client_runtime: DistributedRuntime) -> None:
    procs, client = await start_workers(spawn, client_runtime, TOKEN_DELAY="0.01", GRACE="5")
    # An in-flight request of ~1 s must finish within the grace period. In flight: its first
    # token is out (a fixed wait could signal before the request reached a loaded worker).
    stream = client.stream(body(max_tokens=100), Context(), instance_id=client.instance_ids()[0])
    first = _dec.decode(await asyncio.wait_for(anext(stream), 10))
    procs[0].popen.send_signal(signal.SIGTERM)
    outs = [first, *await asyncio.wait_for(outputs(stream), 10)]
    assert outs[-1].finish_reason is FinishReason.LENGTH
    assert len([t for o in outs for t in o.token_ids]) == 100
    await asyncio.to_thread(procs[0].popen.wait, 10)
    p = procs[0]
    lines = p.output()  # every line: the reader may collect the last ones after the exit
    left, drain, cleanup = p.index_of("left discovery"), p.index_of("DRAIN"), p.index_of("CLEANUP")
    assert -1 < left < drain < cleanup, lines
    # It left discovery: the client no longer sees it.
    async with asyncio.timeout(5):
        while client.instance_ids():
            await asyncio.sleep(0.05)


async def test_instances_follow_discovery_and_a_stopped_one_is_refused(
    spawn: Any, client_runtime: DistributedRuntime
) -> None:
    procs, client = await start_workers(spawn, client_runtime, n=3)
    ids = client.instance_ids()
    counts = dict.fromkeys(ids, 0)
    for i in range(30):  # round-robin over the live instances
        iid = ids[i % len(ids)]
        await outputs(client.stream(body(max_tokens=2), Context(), instance_id=iid))
        counts[iid] += 1
    assert sorted(counts.values()) == [10, 10, 10]
    stopped_id = int(procs[0].wait_for_line("READY").split()[1], 16)
    procs[0].popen.send_signal(signal.SIGTERM)
    await asyncio.to_thread(procs[0].popen.wait, 10)
    async with asyncio.timeout(5):
        while stopped_id in client.instance_ids():
            await asyncio.sleep(0.05)
    live = client.instance_ids()
    assert stopped_id not in live and len(live) == 2
    for i in range(20):
        await outputs(client.stream(body(max_tokens=2), Context(), instance_id=live[i % 2]))
    with pytest.raises(NoInstances):
        client.stream(body(max_tokens=2), Context(), instance_id=stopped_id)
