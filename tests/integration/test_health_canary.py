"""Health-check canaries (FACTS §8): a worker whose engine hangs is marked notready (/health 503)
and leaves routing; when the engine answers again a canary brings it back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx

from dynamo.backend.health_check import HealthCheckConfig
from dynamo.backend.worker import Worker, WorkerConfig
from dynamo.frontend.app import FrontendService
from dynamo.frontend.config import FrontendConfig
from dynamo.mocker.__main__ import build_parser, mocker_config
from dynamo.mocker.config import MockerConfig
from dynamo.mocker.engine import MockerEngine
from dynamo.preprocess import demo_model_path
from dynamo.protocol.output import LLMEngineOutput
from dynamo.protocol.request import PreprocessedRequest
from dynamo.runtime.config import RuntimeConfig
from dynamo.runtime.context import Context
from dynamo.runtime.runtime import DistributedRuntime, InProcessHub

RUNTIME = RuntimeConfig(discovery_backend="memory", request_plane="local", event_plane="local")
CANARIES = HealthCheckConfig(enabled=True, canary_wait_s=0.2, request_timeout_s=1.0)


class HangableMocker(MockerEngine):
    """A mocker that can be made to hang (every request waits, without a word, until released)."""

    def __init__(self, config: MockerConfig) -> None:
        super().__init__(config)
        self._answering = asyncio.Event()
        self._answering.set()
        self.real_requests = 0  # requests that are not canaries

    def hang(self) -> None:
        self._answering.clear()

    def answer(self) -> None:
        self._answering.set()

    async def generate(  # type: ignore[override]
        self, request: PreprocessedRequest, ctx: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        if not (request.request_id or "").startswith("health-check-"):
            self.real_requests += 1
        await self._answering.wait()
        async for out in super().generate(request, ctx):
            yield out

    async def cleanup(self) -> None:
        self.answer()
        await super().cleanup()


def make_worker(hub: InProcessHub) -> tuple[Worker, HangableMocker]:
    path = str(demo_model_path())
    args = build_parser().parse_args(
        ["--model-path", path, "--model-name", "demo", "--speedup-ratio", "0"]
    )
    engine = HangableMocker(mocker_config(args))
    config = WorkerConfig(
        runtime=RUNTIME,
        model_path=path,
        served_model_name="demo",
        install_signal_handlers=False,
        graceful_shutdown_timeout=0.2,
        system_host="127.0.0.1",
        system_port=0,
        health_check=CANARIES,
    )
    return Worker([engine], config, runtime=DistributedRuntime(RUNTIME, hub)), engine


async def until(condition: object, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not await condition():  # type: ignore[operator]
            await asyncio.sleep(0.02)


async def test_a_hung_engine_leaves_routing_and_comes_back() -> None:
    hub = InProcessHub()
    (worker_a, a), (worker_b, b) = make_worker(hub), make_worker(hub)
    tasks = [asyncio.create_task(w.run()) for w in (worker_a, worker_b)]
    frontend = FrontendService(
        FrontendConfig(http_host="127.0.0.1", http_port=0, runtime=RUNTIME), hub=hub
    )
    http = httpx.AsyncClient(timeout=10)
    try:
        await asyncio.wait_for(asyncio.gather(worker_a.ready.wait(), worker_b.ready.wait()), 10)
        await frontend.start()
        base = f"http://127.0.0.1:{frontend.port}"
        assert worker_a.status is not None
        health_a = f"http://127.0.0.1:{worker_a.status.port}/health"
        id_a = worker_a.worker_ids[0]

        def live() -> list[int]:
            models = [m for m in frontend.registry.models() if m.name == "demo"]
            return sorted(models[0].live_instance_ids()) if models else []

        async def live_count(n: int) -> bool:
            return len(live()) == n

        async def completions(n: int) -> None:
            body = {"model": "demo", "prompt": "hello", "max_tokens": 2}
            for _ in range(n):
                r = await http.post(f"{base}/v1/completions", json=body)
                assert r.status_code == 200, r.text

        await until(lambda: live_count(2))
        # Idle and healthy: canaries run and pass, nothing changes.
        await asyncio.sleep(0.6)
        assert (await http.get(health_a)).status_code == 200
        assert len(live()) == 2
        await completions(4)
        assert a.real_requests == 2 and b.real_requests == 2  # round robin

        a.hang()

        async def a_notready() -> bool:
            r = await http.get(health_a)
            return r.status_code == 503 and r.json()["endpoints"] == {"generate": "notready"}

        await until(a_notready)
        await until(lambda: live_count(1))
        assert id_a not in live()
        await completions(6)  # every one succeeds: none goes to the hung engine
        assert a.real_requests == 2 and b.real_requests == 8

        a.answer()

        async def a_ready() -> bool:
            return (await http.get(health_a)).status_code == 200

        await until(a_ready)
        await until(lambda: live_count(2))
        await completions(4)
        assert a.real_requests > 2  # back in routing
    finally:
        await http.aclose()
        await frontend.stop(grace_s=0.5)
        for w in (worker_a, worker_b):
            w.request_shutdown()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 15)
