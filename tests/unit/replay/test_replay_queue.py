"""The router queue in the replay (FACTS §4.5): the live router's queue code on the virtual
clock, held requests routed as capacity frees, the queue limit, refusals."""

from __future__ import annotations

from typing import Any

import pytest

from dynamo.bench.config import BenchConfig
from dynamo.mocker.config import MockerConfig
from dynamo.replay.__main__ import main
from dynamo.replay.deployment import Deployment
from dynamo.replay.run import ReplayResult, run_replay
from dynamo.router.config import KVRouterSettings

ENGINE = MockerConfig(num_gpu_blocks=2048, block_size=16, max_num_batched_tokens=1024)


def _bench(**overrides: Any) -> BenchConfig:
    values: dict[str, Any] = {
        "url": "replay:",
        "workload": "prefix",
        "prefix_groups": 4,
        "prefix_len": 256,
        "suffix_len": 512,
        "osl": 8,
        "rate": 200.0,  # far past what 2 workers prefill: an overload
        "num_requests": 120,
        "seed": 5,
    }
    values.update(overrides)
    return BenchConfig(**values)


def _run(bench: BenchConfig | None = None, **kv: Any) -> ReplayResult:
    deployment = Deployment(2, "kv", kv=KVRouterSettings(**kv), engine=ENGINE)
    return run_replay(bench or _bench(), deployment)


def test_held_requests_all_complete_and_the_run_is_deterministic() -> None:
    a = _run(queue_threshold=0.5)
    b = _run(queue_threshold=0.5)
    assert a.summary["requests"] == {"total": 120, "completed": 120, "failed": 0}
    assert [(f.record.ttft, f.routing) for f in a.flights] == [
        (f.record.ttft, f.routing) for f in b.flights
    ]


def test_the_queue_holds_requests_until_a_worker_has_capacity() -> None:
    """Threshold 0: a worker takes a new request only once no prefill is in flight there, so
    prompts are prefilled one at a time per worker (the engine batches none): requests wait
    longer for their first token than when every request is sent at arrival."""
    free = _run()
    held = _run(queue_threshold=0.0)
    assert held.summary["requests"]["completed"] == 120
    assert held.summary["ttft_ms"]["mean"] > 1.2 * free.summary["ttft_ms"]["mean"]
    loose = _run(queue_threshold=1.0)  # a worker may take up to its whole batch budget
    assert loose.summary["ttft_ms"]["mean"] < held.summary["ttft_ms"]["mean"]


def test_a_full_queue_refuses_with_529() -> None:
    result = _run(queue_threshold=0.0, queue_max_requests=4)
    failed = [f for f in result.flights if not f.record.ok]
    assert failed, "an overload past a 4-request queue must refuse some requests"
    assert {f.record.error for f in failed} == {"http_529"}
    assert all(f.routing is None for f in failed)
    assert result.summary["requests"]["completed"] + len(failed) == 120


@pytest.mark.parametrize("policy", ["fcfs", "wspt", "lcfs"])
def test_every_policy_serves_every_request(policy: str) -> None:
    result = _run(queue_threshold=0.0, queue_policy=policy)
    assert result.summary["requests"]["completed"] == 120


def test_disaggregated_or_non_kv_replays_refuse_the_queue() -> None:
    kv = KVRouterSettings(queue_threshold=0.5)
    with pytest.raises(ValueError, match="router-queue-threshold"):
        Deployment(2, "kv", kv=kv, prefill_workers=1)
    with pytest.raises(ValueError, match="router-queue-threshold"):
        Deployment(2, "round-robin", kv=kv)


def test_cli_takes_the_queue_flags(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--router-mode", "kv", "--workload", "prefix", "--prefix-len", "64"]
    flags += ["--suffix-len", "32", "--osl", "4", "--num-requests", "8", "--no-plots"]
    assert main([*flags, "--router-queue-threshold", "0", "--router-queue-policy", "wspt"]) == 0
    capsys.readouterr()
    assert main([*flags, "--router-queue-threshold", "-1"]) == 2
    assert "router-queue-threshold" in capsys.readouterr().err
