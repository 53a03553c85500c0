"""The KV transfer agent (backend/kv_transfer.py): pulls over loopback TCP, descriptors from
discovery loaded lazily and cached, and the server's limits."""

from __future__ import annotations

import asyncio
import struct

import pytest

from dynamo.backend import kv_transfer
from dynamo.backend.kv_transfer import ExportedBlocks, KVTransferAgent
from dynamo.runtime.config import RuntimeConfig
from dynamo.runtime.errors import CannotConnect, Unknown
from dynamo.runtime.runtime import DistributedRuntime, InProcessHub

RUNTIME = RuntimeConfig(discovery_backend="memory", request_plane="local", event_plane="local")
LAYOUT: dict[str, object] = {"block_size": 4, "dtype": "float32"}


async def export(hashes: list[int]) -> ExportedBlocks:
    if hashes and hashes[0] < 0:
        raise ValueError("no such block")
    kept = [h for h in hashes if h < 100]  # the leading run this side still caches
    return ExportedBlocks(LAYOUT, kept, [h + 1 for h in kept], bytes(range(8)) * len(kept))


@pytest.fixture
async def pair() -> object:
    hub = InProcessHub()
    a, b = DistributedRuntime(RUNTIME, hub), DistributedRuntime(RUNTIME, hub)
    await a.start()
    await b.start()
    server, client = KVTransferAgent(a, export), KVTransferAgent(b, None)
    await server.start(0xA, LAYOUT, num_blocks=64)
    yield server, client
    await server.close()
    await client.close()
    await a.shutdown()
    await b.shutdown()


async def test_pull_moves_the_leading_cached_run(pair: tuple[KVTransferAgent, ...]) -> None:
    server, client = pair
    (got,) = await client.pull(0xA, [1, 2, 3, 200])
    assert got.block_hashes == [1, 2, 3] and got.local_hashes == [2, 3, 4]
    assert got.data == bytes(range(8)) * 3 and got.layout == LAYOUT
    assert (await client.peer(0xA)).port == server.port  # cached after the first pull
    assert client.stats.bytes_received == 24 and server.stats.bytes_sent == 24


async def test_refusals_and_unknown_peers(pair: tuple[KVTransferAgent, ...]) -> None:
    _, client = pair
    with pytest.raises(Unknown, match="no such block"):
        await client.pull(0xA, [-1])
    with pytest.raises(CannotConnect):
        await client.pull(0xB, [1])  # no descriptor in discovery


async def test_oversized_and_silent_clients_are_dropped(
    pair: tuple[KVTransferAgent, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, client = pair
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(struct.pack(">I", kv_transfer.MAX_REQUEST_BYTES + 1))
    (size,) = struct.unpack(">I", await reader.readexactly(4))
    assert b"too big" in await reader.readexactly(size)
    writer.close()
    monkeypatch.setattr(kv_transfer, "REQUEST_TIMEOUT_S", 0.2)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    async with asyncio.timeout(5):
        assert await reader.read() == b""  # said nothing: closed by the server
    writer.close()
    assert (await client.pull(0xA, [5]))[0].block_hashes == [5]  # still serving


async def test_handoff_pulls_by_address_without_a_runtime() -> None:
    """The vLLM connector's use: agents with no runtime, pulls naming a handoff."""
    seen: list[tuple[str, list[int]]] = []

    async def export_handle(handle: str, ids: list[int]) -> ExportedBlocks:
        seen.append((handle, ids))
        return ExportedBlocks(LAYOUT, ids, [], bytes(len(ids)))

    server, client = KVTransferAgent(None, export), KVTransferAgent(None, None)
    server.serve_handles(export_handle)
    port = await server.listen()
    try:
        got = await client.pull_from("127.0.0.1", port, [7, 3], handle="req-1")
        assert got.block_hashes == [7, 3] and got.data == bytes(2) and got.layout == LAYOUT
        assert seen == [("req-1", [7, 3])]
        empty = await client.pull_from("127.0.0.1", port, [], handle="req-2")
        assert empty.data == b"" and seen[-1] == ("req-2", [])
        with pytest.raises(CannotConnect):
            await client.pull(0xA, [1])  # no discovery to find a peer in
        with pytest.raises(RuntimeError):
            await client.start(0xB, LAYOUT, num_blocks=1)  # nothing to publish under
        plain_server = KVTransferAgent(None, export)
        plain_port = await plain_server.listen()
        with pytest.raises(Unknown, match="no KV handoffs"):
            await client.pull_from("127.0.0.1", plain_port, [1], handle="x")
        await plain_server.close()
    finally:
        await server.close()
        await client.close()
