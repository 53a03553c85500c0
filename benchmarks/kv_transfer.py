"""KV transfer benchmark (issue 16): bytes/s of a pull between two processes through the KV
transfer agents (``dynamo.backend.kv_transfer``: the PyTorch engine's block export, TCP on
loopback, the receiving side's buffer) against a plain socket copy of the same bytes.

The serving process holds a real KV pool (``dynamo.pytorch.kv_cache.KVCache``, tiny-Llama-like
layout: 4 layers, 4 KV heads, head size 64, fp32, block size 16) and answers pulls of N blocks
with ``export_slots`` (the torch gather and copy included, as a prefill worker does). The
baseline serves the same byte count from a ready buffer on a plain asyncio socket. Goal: the
agent reaches at least 50 % of the plain copy's rate.

    .venv/bin/python benchmarks/kv_transfer.py [--blocks 512] [--rounds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import statistics
import struct
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LAYOUT = {"num_layers": 4, "block_size": 16, "num_kv_heads": 4, "head_dim": 64, "dtype": "float32"}
POOL_BLOCKS = 2048


def _serve_agent(port_out: multiprocessing.Queue[int], stop: multiprocessing.Event) -> None:
    import msgspec
    import torch

    from dynamo.backend.kv_transfer import ExportedBlocks, KVTransferAgent
    from dynamo.pytorch.kv_cache import KVCache, KVLayout

    layout = msgspec.convert(LAYOUT, KVLayout)
    cache = KVCache.allocate(layout, POOL_BLOCKS, torch.device("cpu"))
    for k, v in cache.pools:
        k.normal_()
        v.normal_()

    async def export(hashes: list[int]) -> ExportedBlocks:
        slots = [h % POOL_BLOCKS for h in hashes]
        data = await asyncio.to_thread(cache.export_slots, slots)
        return ExportedBlocks(LAYOUT, hashes, hashes, data)  # type: ignore[arg-type]

    async def main() -> None:
        agent = KVTransferAgent.__new__(KVTransferAgent)
        KVTransferAgent.__init__(agent, None, export)  # type: ignore[arg-type]
        server = await asyncio.start_server(agent._accept, "127.0.0.1", 0, limit=1 << 20)
        port_out.put(server.sockets[0].getsockname()[1])
        while not stop.is_set():
            await asyncio.sleep(0.1)
        server.close()

    asyncio.run(main())


def _serve_plain(port_out: multiprocessing.Queue[int], stop: multiprocessing.Event) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        (n,) = struct.unpack(">Q", await reader.readexactly(8))
        writer.write(bytes(n))
        await writer.drain()
        writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0, limit=1 << 20)
        port_out.put(server.sockets[0].getsockname()[1])
        while not stop.is_set():
            await asyncio.sleep(0.1)
        server.close()

    asyncio.run(main())


async def _pull_agent(port: int, blocks: int, rounds: int) -> tuple[float, int]:
    from dynamo.backend.kv_transfer import AgentDescriptor, KVTransferAgent

    agent = KVTransferAgent.__new__(KVTransferAgent)
    KVTransferAgent.__init__(agent, None, None)  # type: ignore[arg-type]
    agent._peers[1] = AgentDescriptor(host="127.0.0.1", port=port, layout=LAYOUT)
    hashes = list(range(blocks))  # contiguous slots: merged into one run per (layer, K/V)
    await agent.pull(1, hashes)  # warm-up
    rates = []
    size = 0
    for _ in range(rounds):
        t = time.perf_counter()
        (got,) = await agent.pull(1, hashes)
        rates.append(len(got.data) / (time.perf_counter() - t))
        size = len(got.data)
    return statistics.median(rates), size


async def _pull_plain(port: int, size: int, rounds: int) -> float:
    rates = []
    for _ in range(rounds + 1):
        t = time.perf_counter()
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
        writer.write(struct.pack(">Q", size))
        data = await reader.readexactly(size)
        writer.close()
        rates.append(len(data) / (time.perf_counter() - t))
    return statistics.median(rates[1:])


def _with_server(target: object) -> tuple[multiprocessing.Process, int, multiprocessing.Event]:
    ctx = multiprocessing.get_context("spawn")
    ports: multiprocessing.Queue[int] = ctx.Queue()
    stop = ctx.Event()
    proc = ctx.Process(target=target, args=(ports, stop), daemon=True)  # type: ignore[arg-type]
    proc.start()
    return proc, ports.get(timeout=60), stop  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", default=str(REPO / "bench-results" / "kv_transfer.json"))
    args = parser.parse_args(argv)
    proc, port, stop = _with_server(_serve_agent)
    try:
        agent_rate, size = asyncio.run(_pull_agent(port, args.blocks, args.rounds))
    finally:
        stop.set()
        proc.join(10)
    proc, port, stop = _with_server(_serve_plain)
    try:
        plain_rate = asyncio.run(_pull_plain(port, size, args.rounds))
    finally:
        stop.set()
        proc.join(10)
    ratio = agent_rate / plain_rate
    print(
        f"{size / 2**20:.1f} MiB per pull ({args.blocks} blocks):"
        f" agent {agent_rate / 1e9:.2f} GB/s,"
        f" plain socket {plain_rate / 1e9:.2f} GB/s, ratio {ratio:.0%}"
        f" (goal >= 50 %: {'met' if ratio >= 0.5 else 'missed'})"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "machine": f"{platform.node()} ({os.cpu_count()} cores)",
                "bytes_per_pull": size,
                "agent_bytes_per_s": agent_rate,
                "plain_bytes_per_s": plain_rate,
                "ratio": ratio,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
