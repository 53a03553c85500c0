"""The TCP request plane against a server in another process: normal streams, typed errors,
cancellation, and SIGKILL of the server mid-stream (StreamIncomplete, no hang)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator

import pytest

from dynamo.runtime.context import Context
from dynamo.runtime.errors import InvalidArgument, StreamIncomplete
from dynamo.runtime.request_plane.tcp import TCPRequestPlaneClient

pytestmark = pytest.mark.e2e

SERVER = r"""
import asyncio, sys
from dynamo.runtime.errors import InvalidArgument
from dynamo.runtime.request_plane.tcp import TCPRequestPlaneServer

async def count(body, ctx):
    for i in range(int(body)):
        yield b"%d" % i

async def until_stopped(body, ctx):
    while not ctx.is_stopped():
        yield b"tok"
        await asyncio.sleep(0.01)
    yield b"cancelled"

async def failing(body, ctx):
    yield b"partial"
    raise InvalidArgument("bad request: " + body.decode())

async def main():
    server = TCPRequestPlaneServer("127.0.0.1", 0)
    server.register("t.w.count", count)
    server.register("t.w.until_stopped", until_stopped)
    server.register("t.w.failing", failing)
    await server.start()
    print(server.address, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop()

asyncio.run(main())
"""


@pytest.fixture
def worker() -> Iterator[tuple[subprocess.Popen[str], str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().strip()
        assert address.startswith("tcp://127.0.0.1:"), address
        yield proc, address
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.fixture
async def client() -> AsyncIterator[TCPRequestPlaneClient]:
    cli = TCPRequestPlaneClient()
    yield cli
    await cli.close()


async def test_streams_and_typed_errors(
    worker: tuple[subprocess.Popen[str], str], client: TCPRequestPlaneClient
) -> None:
    _, address = worker
    async with asyncio.timeout(10):
        got = [b async for b in client.stream(address, "t.w.count", b"1000", Context())]
        assert got == [b"%d" % i for i in range(1000)]
        partial: list[bytes] = []
        with pytest.raises(InvalidArgument, match="bad request: x"):
            async for body in client.stream(address, "t.w.failing", b"x", Context()):
                partial.append(body)
        assert partial == [b"partial"]


async def test_cancel_ends_the_stream_promptly(
    worker: tuple[subprocess.Popen[str], str], client: TCPRequestPlaneClient
) -> None:
    _, address = worker
    ctx = Context()
    got: list[bytes] = []
    async with asyncio.timeout(10):
        async for body in client.stream(address, "t.w.until_stopped", b"", ctx):
            got.append(body)
            if len(got) == 3:
                ctx.stop_generating()
                stopped_at = time.monotonic()
    assert got[-1] == b"cancelled"
    # prompt: the handler streams until stopped (generous: a loaded CI machine)
    assert time.monotonic() - stopped_at < 5.0


async def test_sigkill_mid_stream_gives_stream_incomplete(
    worker: tuple[subprocess.Popen[str], str], client: TCPRequestPlaneClient
) -> None:
    proc, address = worker
    got: list[bytes] = []
    with pytest.raises(StreamIncomplete):
        async with asyncio.timeout(10):
            async for body in client.stream(address, "t.w.until_stopped", b"", Context()):
                got.append(body)
                if len(got) == 3:
                    os.kill(proc.pid, signal.SIGKILL)
                    killed_at = time.monotonic()
    assert time.monotonic() - killed_at < 5.0  # at once, not a hang (generous: a loaded CI)
    assert len(got) >= 3
