"""Single-request replays reproduce the reference's timing table (FACTS §6.4) exactly: the
replay is the mocker's scheduler and timing model on a virtual clock, with nothing added."""

from __future__ import annotations

import dataclasses

import pytest

from dynamo.bench.config import BenchConfig
from dynamo.mocker.config import MockerConfig
from dynamo.replay.deployment import Deployment
from dynamo.replay.run import ReplayResult, run_replay

EXACT = 1e-6  # ms: the table's printed precision


def _replay(
    isl: int, osl: int, *, concurrency: int = 1, requests: int = 1, **engine: object
) -> ReplayResult:
    bench = BenchConfig(
        url="replay:",
        workload="synthetic",
        isl=isl,
        osl=osl,
        concurrency=concurrency,
        num_requests=requests,
    )
    cfg = dataclasses.replace(MockerConfig(), **engine)  # type: ignore[arg-type]
    return run_replay(bench, Deployment(workers=1, router_mode="round-robin", engine=cfg))


def test_one_request_prefill_then_decodes() -> None:
    result = _replay(1024, 4)
    (record,) = result.records
    assert record.ttft is not None
    assert record.ttft * 1000 == pytest.approx(32.490712, abs=EXACT)
    itl = [gap * 1000 for gap in record.itl]
    assert itl[0] == pytest.approx(5.792771, abs=EXACT)  # D(1025)
    assert itl[-1] == pytest.approx(5.792874, abs=EXACT)  # D(1027)
    assert len(itl) == 3 and record.output_tokens == 4


def test_two_simultaneous_requests_share_one_prefill() -> None:
    result = _replay(1024, 4, concurrency=2, requests=2)
    for record in result.records:
        assert record.ttft is not None
        assert record.ttft * 1000 == pytest.approx(49.362902, abs=EXACT)  # P(2048)


def test_long_prompt_is_chunked() -> None:
    (record,) = _replay(10000, 2).records
    assert record.ttft is not None
    assert record.ttft * 1000 == pytest.approx(214.466186, abs=EXACT)  # P(8192) + P(1808)


def test_speedup_ratios() -> None:
    (fast,) = _replay(1024, 4, speedup_ratio=2.0).records
    assert fast.ttft is not None
    assert fast.ttft * 1000 == pytest.approx(32.490712 / 2, abs=EXACT)
    assert fast.itl[0] * 1000 == pytest.approx(5.792771 / 2, abs=EXACT)
    (decode_fast,) = _replay(1024, 4, decode_speedup_ratio=2.0).records
    assert decode_fast.ttft is not None
    assert decode_fast.ttft * 1000 == pytest.approx(32.490712, abs=EXACT)
    assert decode_fast.itl[0] * 1000 == pytest.approx(5.792771 / 2, abs=EXACT)


@pytest.mark.parametrize(
    ("bandwidth", "bytes_per_token", "ttft_ms"),
    [(None, None, 38.2834), (64.0, 131072, 40.3806), (10.0, 131072, 51.7052)],
)
def test_disaggregated_ttft(
    bandwidth: float | None, bytes_per_token: int | None, ttft_ms: float
) -> None:
    """1P1D: prefill on the prefill worker + KV transfer + the decode worker's first pass."""
    bench = BenchConfig(url="replay:", workload="synthetic", isl=1024, osl=4, num_requests=1)
    engine = MockerConfig(kv_transfer_bandwidth=bandwidth, kv_bytes_per_token=bytes_per_token)
    deployment = Deployment(workers=1, prefill_workers=1, router_mode="kv", engine=engine)
    (record,) = run_replay(bench, deployment).records
    assert record.ok and record.ttft is not None
    assert record.ttft * 1000 == pytest.approx(ttft_ms, abs=1e-3)
    assert record.output_tokens == 4


def test_conditional_disaggregation_keeps_short_prompts_local() -> None:
    """The frontend's rule: a prompt whose uncached part is at most max_local_prefill_length
    (1000) prefills on its decode worker; a longer one goes to a prefill worker."""
    engine = MockerConfig(num_gpu_blocks=1024, block_size=16)
    deployment = Deployment(workers=1, prefill_workers=1, router_mode="kv", engine=engine)
    for isl, remote in ((512, False), (1024, True)):
        bench = BenchConfig(url="replay:", workload="synthetic", isl=isl, osl=2, num_requests=1)
        (flight,) = run_replay(bench, deployment).flights
        assert flight.record.ok and flight.routing is not None
        assert (flight.routing.prefill_worker_id is not None) is remote
        assert flight.routing.worker_id == 0x1000  # the decode worker produces the tokens
