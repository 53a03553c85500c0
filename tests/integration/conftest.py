"""The whole system in one process: memory discovery, in-process planes, real HTTP on port 0."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from dynamo.backend.serve_engine import ServeOptions
from dynamo.backend.worker import Worker
from dynamo.frontend.app import FrontendService
from dynamo.frontend.config import FrontendConfig
from dynamo.mocker.__main__ import build_parser, build_worker, mocker_config
from dynamo.preprocess import demo_model_path
from dynamo.router.config import KVRouterSettings
from dynamo.runtime.config import RuntimeConfig
from dynamo.runtime.runtime import InProcessHub

RUNTIME = RuntimeConfig(discovery_backend="memory", request_plane="local", event_plane="local")


@dataclass
class Stack:
    hub: InProcessHub
    frontend: FrontendService | None = None
    workers: list[Worker] = field(default_factory=list)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    client: httpx.AsyncClient | None = None
    runtime: RuntimeConfig = RUNTIME  # the planes; discovery stays in the hub's memory store

    async def add_worker(self, *mocker_flags: str) -> Worker:
        args = build_parser().parse_args(
            ["--model-path", str(demo_model_path()), "--model-name", "demo", *mocker_flags]
        )
        worker = build_worker(
            mocker_config(args),
            self.runtime,
            hub=self.hub,
            install_signal_handlers=False,
            options=ServeOptions.from_args(args),  # the worker flags, e.g. the grace period
        )
        self.workers.append(worker)
        self.tasks.append(asyncio.create_task(worker.run(), name="test-worker"))
        await asyncio.wait_for(worker.ready.wait(), 10)
        return worker

    async def start_frontend(self, **config: Any) -> httpx.AsyncClient:
        self.frontend = FrontendService(
            FrontendConfig(http_host="127.0.0.1", http_port=0, runtime=self.runtime, **config),
            hub=self.hub,
        )
        await self.frontend.start()
        self.client = httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{self.frontend.port}", timeout=30
        )
        return self.client

    async def wait_for_model(self, name: str = "demo", instances: int = 1) -> None:
        assert self.frontend is not None
        async with asyncio.timeout(10):
            while True:
                models = self.frontend.registry.models()
                if any(
                    m.name == name and len(m.live_instance_ids(m.serving_role())) >= instances
                    for m in models
                ):
                    return
                await asyncio.sleep(0.02)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()
        if self.frontend is not None:
            await self.frontend.stop(grace_s=0.5)
        for worker in self.workers:
            worker.request_shutdown()
        await asyncio.gather(*self.tasks, return_exceptions=True)


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    s = Stack(InProcessHub())
    yield s
    await s.close()


def kv_settings(**kw: Any) -> KVRouterSettings:
    return KVRouterSettings(**kw)


StackFactory = Callable[[], Stack]
