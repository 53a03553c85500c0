"""Conditional disaggregation (frontend/disagg.py): the rules, the queue bound and the run-time
overrides from discovery."""

from __future__ import annotations

import asyncio

import pytest

from dynamo.frontend.disagg import (
    DisaggOverrides,
    Disaggregation,
    DisaggSettings,
    prefill_only,
    set_overrides,
)
from dynamo.protocol.request import (
    OutputOptions,
    PreprocessedRequest,
    RoutingHints,
    StopConditions,
)
from dynamo.runtime.config import RuntimeConfig
from dynamo.runtime.runtime import DistributedRuntime, InProcessHub

RUNTIME = RuntimeConfig(discovery_backend="memory", request_plane="local", event_plane="local")


def test_prefill_length_rule_counts_only_what_the_decode_worker_lacks() -> None:
    d = Disaggregation(DisaggSettings(max_local_prefill_length=1000), DistributedRuntime(RUNTIME))
    assert d.remote("m", 4000, 0, 1)
    assert not d.remote("m", 1000, 0, 1)  # not longer than the local limit
    assert not d.remote("m", 4000, 3200, 1)  # 800 left after the decode worker's prefix hit


def test_queue_bound_keeps_prefills_local_when_prefill_workers_are_backed_up() -> None:
    d = Disaggregation(DisaggSettings(max_prefill_queue_size=2), DistributedRuntime(RUNTIME))
    d._state("m").inflight = 3  # one per prefill worker runs; one waits
    assert d.queue_depth("m", 2) == 1
    assert d.remote("m", 4000, 0, 2)
    d._state("m").inflight = 4
    assert d.queue_depth("m", 2) == 2
    assert not d.remote("m", 4000, 0, 2)


def test_isl_bounding_rule() -> None:
    d = Disaggregation(DisaggSettings(rule="isl-bounding"), DistributedRuntime(RUNTIME))
    assert d.remote("m", 500, 0, 1)  # no hit: ratio 1.0 is not below 0.7
    assert not d.remote("m", 3000, 2000, 1)  # effective 1000 < 2048 and ratio 0.33 < 0.7
    assert d.remote("m", 10000, 5000, 1)  # effective 5000 is not below 2048


@pytest.mark.parametrize(
    "kwargs",
    [{"dispatch": "carrier-pigeon"}, {"rule": "coin"}, {"max_local_prefill_length": -1}],
)
def test_bad_settings_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        DisaggSettings(**kwargs)  # type: ignore[arg-type]


async def test_overrides_follow_discovery() -> None:
    runtime = DistributedRuntime(RUNTIME, InProcessHub())
    await runtime.start()
    d = Disaggregation(DisaggSettings(), runtime)
    try:
        await d.start()
        assert d.thresholds("m") == (1000, 2)
        await set_overrides(runtime.discovery, runtime.namespace, "m", DisaggOverrides(7, 5))
        async with asyncio.timeout(5):
            while d.thresholds("m") != (7, 5):
                await asyncio.sleep(0.01)
        await runtime.discovery.put("v1/disagg_router/dynamo/m", b'{"max_prefill_queue_size": -1}')
        await runtime.discovery.put("v1/disagg_router/dynamo/m", b"not json")
        await set_overrides(
            runtime.discovery, runtime.namespace, "m", DisaggOverrides(max_prefill_queue_size=9)
        )
        async with asyncio.timeout(5):
            while d.thresholds("m") != (1000, 9):  # bad values were ignored, then replaced
                await asyncio.sleep(0.01)
        await runtime.discovery.delete("v1/disagg_router/dynamo/m")
        async with asyncio.timeout(5):
            while d.thresholds("m") != (1000, 2):
                await asyncio.sleep(0.01)
        assert d.thresholds("other") == (1000, 2)
    finally:
        await d.close()
        await runtime.shutdown()


def test_prefill_request_asks_for_one_token_and_no_output_extras() -> None:
    request = PreprocessedRequest(
        model="m",
        token_ids=[1, 2, 3],
        stop=StopConditions(max_tokens=50, min_tokens=10),
        output=OutputOptions(logprobs=3),
        routing=RoutingHints(backend_instance_id=5, prefill_worker_id=9, prefill_dp_rank=1),
    )
    pre = prefill_only(request)
    assert pre.stop.max_tokens == 1 and pre.stop.min_tokens is None
    assert pre.output == OutputOptions()
    assert pre.routing == RoutingHints(backend_instance_id=9, dp_rank=1)
    assert request.stop.max_tokens == 50  # the caller's request is not mutated
