"""Health-check canary settings, payloads and probe outcomes (FACTS §8)."""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dynamo.backend.engine import chunk
from dynamo.backend.health_check import (
    HealthCanary,
    HealthCheckConfig,
    canary_payload,
    parse_payload,
)
from dynamo.backend.worker import Worker, WorkerConfig
from dynamo.protocol.output import LLMEngineOutput
from dynamo.protocol.request import PreprocessedRequest, StopConditions
from dynamo.runtime.config import RuntimeConfig
from dynamo.runtime.context import Context
from dynamo.runtime.naming import EndpointId
from dynamo.runtime.runtime import DistributedRuntime, InProcessHub
from tests.fakes import CountingEngine

RUNTIME = RuntimeConfig(discovery_backend="memory", request_plane="local", event_plane="local")
# a generous timeout: a passing canary on a starved CI machine must not time out
FAST = HealthCheckConfig(enabled=True, canary_wait_s=0.05, request_timeout_s=10.0)


def _parsed(argv: list[str]) -> HealthCheckConfig:
    parser = argparse.ArgumentParser()
    HealthCheckConfig.add_arguments(parser)
    return HealthCheckConfig.from_args(parser.parse_args(argv))


def test_settings_from_flags_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("ENABLED", "REQUEST_TIMEOUT", "PAYLOAD"):
        monkeypatch.delenv(f"DYN_HEALTH_CHECK_{name}", raising=False)
    monkeypatch.delenv("DYN_CANARY_WAIT_TIME", raising=False)
    assert _parsed([]) == HealthCheckConfig(False, 10.0, 3.0, None) == HealthCheckConfig()
    flags = ["--health-check-enabled", "--canary-wait-time=2.5"]
    flags += ["--health-check-request-timeout=0.5", '--health-check-payload={"token_ids": [1]}']
    assert _parsed(flags) == HealthCheckConfig(True, 2.5, 0.5, '{"token_ids": [1]}')
    monkeypatch.setenv("DYN_HEALTH_CHECK_ENABLED", "true")
    monkeypatch.setenv("DYN_CANARY_WAIT_TIME", "2.5")
    monkeypatch.setenv("DYN_HEALTH_CHECK_REQUEST_TIMEOUT", "0.5")
    monkeypatch.setenv("DYN_HEALTH_CHECK_PAYLOAD", '{"token_ids": [1]}')
    assert _parsed([]) == HealthCheckConfig(True, 2.5, 0.5, '{"token_ids": [1]}')
    assert _parsed(["--no-health-check-enabled"]).enabled is False  # the flag wins
    monkeypatch.setenv("DYN_CANARY_WAIT_TIME", "soon")
    with pytest.raises(ValueError, match="DYN_CANARY_WAIT_TIME"):
        _parsed([])
    monkeypatch.setenv("DYN_CANARY_WAIT_TIME", "2.5")
    monkeypatch.setenv("DYN_HEALTH_CHECK_ENABLED", "sometimes")
    with pytest.raises(ValueError, match="DYN_HEALTH_CHECK_ENABLED"):
        _parsed([])
    with pytest.raises(ValueError, match="positive"):
        HealthCheckConfig(canary_wait_s=0)


def test_payload_json_file_and_reference_names(tmp_path: Path) -> None:
    p = parse_payload('{"token_ids": [5, 6], "stop": {"max_tokens": 1}}', "demo")
    assert (p.model, p.token_ids, p.stop.max_tokens) == ("demo", [5, 6], 1)
    ref = '{"token_ids": [1], "stop_conditions": {"max_tokens": 1, "ignore_eos": true},'
    ref += ' "sampling_options": {"temperature": 0.0}, "model": "other"}'
    q = parse_payload(ref, "demo")
    assert q.model == "other" and q.stop.ignore_eos and q.sampling.temperature == 0.0
    f = tmp_path / "canary.json"
    f.write_text('{"token_ids": [9]}')
    assert parse_payload(f"@{f}", "demo").token_ids == [9]
    for bad, message in (
        ("not json", "not JSON"),
        ("[1, 2]", "JSON object"),
        ('{"token_ids": "abc"}', "not a request"),
        ('{"stop": {}}', "not a request"),  # token_ids is required
    ):
        with pytest.raises(ValueError, match=message):
            parse_payload(bad, "demo")
    with pytest.raises(OSError):
        parse_payload(f"@{tmp_path / 'missing.json'}", "demo")


class Probed(CountingEngine):
    """Answers canaries with ``mode``: "ok", "error" (an error terminal) or "raise"."""

    def __init__(self, mode: str = "ok", payload: bool = True) -> None:
        super().__init__()
        self.mode = mode
        self.payload = payload

    def health_check_payload(self) -> PreprocessedRequest | None:
        if not self.payload:
            return None
        return PreprocessedRequest(
            model="test-model", token_ids=[1], stop=StopConditions(max_tokens=1)
        )

    async def generate(
        self, request: PreprocessedRequest, ctx: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        if self.mode == "error":
            yield chunk.error("out of memory")
            return
        if self.mode == "raise":
            raise RuntimeError("crashed")
        async for out in super().generate(request, ctx):
            yield out


Observed = tuple[dict[str, bool], int]


async def run_worker(
    engine: Probed, hc: HealthCheckConfig, seconds: float, until: Observed | None = None
) -> Observed:
    """Serve ``engine`` for ``seconds`` (or, given ``until``, until it is observed: 10 s at
    most); then its health and how many instances discovery has."""
    config = WorkerConfig(runtime=RUNTIME, install_signal_handlers=False, health_check=hc)
    worker = Worker([engine], config, runtime=DistributedRuntime(RUNTIME, InProcessHub()))
    task = asyncio.create_task(worker.run())

    async def observed() -> Observed:
        health = worker._health()  # noqa: SLF001 - what /health serves
        registered = await worker.runtime.discovery.get_prefix("v1/instances/")
        return health, len(registered)

    try:
        await asyncio.wait_for(worker.ready.wait(), 10)
        await asyncio.sleep(seconds)
        async with asyncio.timeout(10):
            while until is not None and await observed() != until:
                await asyncio.sleep(0.02)
        return await observed()
    finally:
        worker.request_shutdown()
        await asyncio.wait_for(task, 10)


@pytest.mark.parametrize("mode", ["error", "raise"])
async def test_a_failing_canary_marks_notready_and_withdraws(mode: str) -> None:
    # waited for: the canary's failure and the withdrawal take a few loop turns after its
    # 0.05 s wait, which a loaded machine can stretch past a fixed sleep
    notready = ({"generate": False}, 0)
    assert await run_worker(Probed(mode), FAST, 0.0, until=notready) == notready


async def test_a_passing_canary_keeps_the_instance() -> None:
    assert await run_worker(Probed("ok"), FAST, 0.3) == ({"generate": True}, 1)


async def test_no_canary_when_disabled_or_without_a_payload() -> None:
    for engine, hc in ((Probed("error"), HealthCheckConfig()), (Probed("error", False), FAST)):
        assert await run_worker(engine, hc, 0.2) == ({"generate": True}, 1)


async def test_a_busy_instance_is_not_probed() -> None:
    runtime = DistributedRuntime(RUNTIME, InProcessHub())
    await runtime.start()
    try:

        async def handler(body: bytes, ctx: Context) -> AsyncIterator[bytes]:
            yield b""

        served = await runtime.serve_endpoint(EndpointId("dynamo", "backend", "generate"), handler)
        payload = PreprocessedRequest(model="m", token_ids=[1])
        canary = HealthCanary(runtime, served, payload, FAST, time.monotonic)  # always active
        canary.start()
        await asyncio.sleep(0.3)
        await canary.stop()
        assert canary.probes == 0 and canary.healthy
    finally:
        await runtime.shutdown()


def test_the_override_wins_and_an_invalid_one_falls_back(caplog: pytest.LogCaptureFixture) -> None:
    engine = Probed()
    override = canary_payload(engine, HealthCheckConfig(payload='{"token_ids": [7]}'), "m")
    assert override is not None and (override.model, override.token_ids) == ("m", [7])
    assert canary_payload(engine, HealthCheckConfig(payload="nope"), "m") == (
        engine.health_check_payload()
    )
    assert "not JSON" in caplog.text
    assert canary_payload(Probed(payload=False), HealthCheckConfig(), "m") is None
