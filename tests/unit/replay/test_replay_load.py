"""The replay honours ``dynamo bench``'s ``--warmup`` and ``--request-timeout`` on the virtual
clock: warm-up requests run but are not reported; a request past its timeout is abandoned and
frees everything it held."""

from __future__ import annotations

from typing import Any

import pytest

from dynamo.bench.config import BenchConfig
from dynamo.frontend.disagg import DisaggSettings
from dynamo.mocker.config import MockerConfig
from dynamo.replay.__main__ import main
from dynamo.replay.deployment import Deployment
from dynamo.replay.flight import SimulationResult
from dynamo.replay.run import run_replay
from dynamo.replay.simulator import Simulation
from tests.unit.replay.simulations import simulation

ENGINE = MockerConfig(num_gpu_blocks=512, block_size=16)


def _bench(**overrides: Any) -> BenchConfig:
    values: dict[str, Any] = {
        "url": "replay:",
        "workload": "prefix",
        "prefix_groups": 4,
        "prefix_len": 128,
        "suffix_len": 32,
        "osl": 8,
        "concurrency": 8,
        "num_requests": 32,
        "isl": 64,
    }
    values.update(overrides)
    return BenchConfig(**values)


def test_warmup_requests_run_first_and_are_not_reported() -> None:
    cold = run_replay(_bench(), Deployment(2, "kv", engine=ENGINE))
    warm = run_replay(_bench(warmup=24), Deployment(2, "kv", engine=ENGINE))
    assert warm.summary["requests"] == {"total": 32, "completed": 32, "failed": 0}
    assert all(f.request_id.startswith("replay-") for f in warm.flights)
    assert [f.index for f in warm.flights] == list(range(32))
    # the measured phase starts its clock after the warm-up, as dynamo bench's does
    assert warm.simulation.warmup_s > 0
    assert warm.summary["replay"]["warmup_simulated_s"] == warm.simulation.warmup_s
    assert min(f.record.start for f in warm.flights) == 0.0
    # the warm-up ran on the same engines: more passes than the measured requests need
    assert warm.simulation.passes > cold.simulation.passes
    # and deterministically
    again = run_replay(_bench(warmup=24), Deployment(2, "kv", engine=ENGINE))
    assert [f.record.end for f in again.flights] == [f.record.end for f in warm.flights]


def _simulate(bench: BenchConfig, deployment: Deployment) -> tuple[Simulation, SimulationResult]:
    sim = simulation(bench, deployment)
    return sim, sim.run()


@pytest.mark.parametrize(("prefill_workers", "isl"), [(0, 512), (1, 2048)])
def test_request_timeout_abandons_and_frees(prefill_workers: int, isl: int) -> None:
    """An overloaded open loop: requests past their timeout end with ``timeout`` at exactly
    their deadline, their engines and routers hold nothing of them afterwards. Disaggregated,
    every prompt goes to the prefill worker, so requests time out waiting there, during their
    prefill pass, and decoding."""
    timeout = 1.5
    bench = _bench(workload="synthetic", isl=isl, osl=32, rate=150.0, num_requests=60)
    bench.request_timeout_s = timeout
    remote = DisaggSettings(max_local_prefill_length=0, max_prefill_queue_size=1000)
    deployment = Deployment(1, "kv", engine=ENGINE, prefill_workers=prefill_workers, disagg=remote)
    sim, result = _simulate(bench, deployment)
    records = [f.record for f in result.flights]
    timed_out = [r for r in records if r.error == "timeout"]
    assert len(records) == 60
    assert 0 < len(timed_out) < 60
    for r in timed_out:
        assert r.e2e == pytest.approx(timeout)
        assert r.output_tokens < 32  # no token after the client gave up
        assert r.error_message == f"no complete response within {timeout} s"
    assert all(r.ok for r in records if r.error != "timeout")
    assert all(r.e2e <= timeout + 1e-9 for r in records)
    pools = [sim.decode_pool] + ([sim.prefill_pool] if sim.prefill_pool else [])
    for pool in pools:
        assert pool.core is not None and len(pool.core.sequences) == 0
        for rank in pool.ranks.values():
            assert not rank.sched.has_work
            assert rank.sched.kv.num_active_blocks == 0
            rank.sched.check_invariants()


def test_cli_takes_warmup_and_request_timeout(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "--workers", "1", "--router-mode", "kv", "--block-size", "16",
            "--num-gpu-blocks-override", "512", "--workload", "synthetic", "--isl", "256",
            "--osl", "16", "--rate", "400", "--num-requests", "30", "--warmup", "4",
            "--request-timeout", "0.2", "--json",
        ]
    )  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert '"timeout"' in out and '"warmup_simulated_s"' in out
