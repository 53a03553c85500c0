"""Shared fixtures for end-to-end tests: subprocess management on loopback."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from dynamo.runtime.config import RuntimeConfig
from dynamo.runtime.runtime import DistributedRuntime
from tests.e2e.processes import Child


@pytest.fixture
def discovery_dir(tmp_path: Path) -> str:
    d = tmp_path / "discovery"
    d.mkdir()
    return str(d)


@pytest.fixture
async def runtime(discovery_dir: str) -> AsyncIterator[DistributedRuntime]:
    """A client runtime on the test's file discovery (the processes' view of the world)."""
    rt = DistributedRuntime(RuntimeConfig(discovery_backend="file", discovery_dir=discovery_dir))
    await rt.start()
    yield rt
    await rt.shutdown()


@pytest.fixture
def spawn(discovery_dir: str) -> Iterator[object]:
    procs: list[Child] = []

    def _spawn(args: list[str], **env_extra: str) -> Child:
        env = dict(os.environ)
        env["DYN_FILE_KV"] = discovery_dir
        env["PYTHONUNBUFFERED"] = "1"
        env.update(env_extra)
        proc = Child(args, env)
        procs.append(proc)
        return proc

    yield _spawn
    for proc in procs:
        proc.stop()
