"""File discovery across real processes: peers see each other; a SIGKILLed peer's entries vanish
within the lease TTL; a cleanly closed peer's entries vanish at once; no garbage is left."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from dynamo.runtime.discovery.file import FileDiscovery

pytestmark = pytest.mark.e2e

HELPER = Path(__file__).parent / "helpers" / "file_discovery_peer.py"
TTL = 1.5
SLACK = 1.0  # scheduling slack on a loaded 2-core machine (the peers poll every 0.05 s)
STARTUP = 30.0


class Peer:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._changed = asyncio.Event()
        self._reader = asyncio.create_task(self._read(), name=f"peer-{proc.pid}-stdout")

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        async for raw in self.proc.stdout:
            self.lines.append(raw.decode().strip())
            self._changed.set()

    async def expect(self, line: str, timeout: float) -> None:
        async with asyncio.timeout(timeout):
            while line not in self.lines:
                self._changed.clear()
                await self._changed.wait()

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
        await self.proc.wait()
        await self._reader


@asynccontextmanager
async def peers(directory: Path) -> AsyncIterator[Callable[[str], Awaitable[Peer]]]:
    started: list[Peer] = []

    async def spawn(name: str) -> Peer:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(HELPER),
            str(directory),
            name,
            str(TTL),
            stdout=asyncio.subprocess.PIPE,
        )
        peer = Peer(proc)
        started.append(peer)
        return peer

    try:
        yield spawn
    finally:
        for peer in started:
            await peer.stop()


async def test_peers_see_each_other_and_dead_peers_vanish(tmp_path: Path) -> None:
    loop = asyncio.get_running_loop()
    observer = FileDiscovery(tmp_path)
    try:
        async with peers(tmp_path) as spawn:
            a, b = await spawn("a"), await spawn("b")
            await a.expect("READY", STARTUP)
            await b.expect("READY", STARTUP)
            await a.expect("put peers/b", STARTUP)
            await b.expect("put peers/a", STARTUP)
            b_record = await observer.get("peers/b")
            assert b_record is not None and b_record.value == str(b.proc.pid).encode()

            b.proc.send_signal(signal.SIGKILL)
            killed_at = loop.time()
            await b.proc.wait()
            while await observer.get("peers/b") is not None:
                assert loop.time() - killed_at <= TTL + SLACK, "SIGKILLed entry outlived its TTL"
                await asyncio.sleep(0.02)
            print(f"SIGKILLed peer's entry gone after {loop.time() - killed_at:.2f}s (TTL {TTL}s)")
            # The surviving peer's watch reports it too (it polls, and collects the garbage).
            await a.expect("delete peers/b", TTL + SLACK - (loop.time() - killed_at) + 0.5)
            assert await observer.get("peers/a") is not None

            a.proc.send_signal(signal.SIGTERM)
            await a.expect("CLOSED", 10.0)
            assert await asyncio.wait_for(a.proc.wait(), 10.0) == 0
            assert await observer.get("peers/a") is None  # revoked on close: gone at once
            assert await observer.get_prefix("") == []
        assert os.listdir(tmp_path / "kv") == []
        assert os.listdir(tmp_path / "leases") == []
    finally:
        await observer.close()
