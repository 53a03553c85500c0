"""The replay end to end in one process: determinism, load loops, workloads, reports, CLI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dynamo.bench.config import BenchConfig
from dynamo.mocker.config import MockerConfig
from dynamo.replay.__main__ import main
from dynamo.replay.deployment import Deployment
from dynamo.replay.run import ReplayResult, run_replay

ENGINE = MockerConfig(num_gpu_blocks=512, block_size=16)
_VOLATILE = ("date", "replay")  # the run's date and wall-clock figures


def _prefix_bench(**overrides: Any) -> BenchConfig:
    values: dict[str, Any] = {
        "url": "replay:",
        "workload": "prefix",
        "prefix_groups": 8,
        "prefix_len": 256,
        "suffix_len": 64,
        "osl": 16,
        "concurrency": 16,
        "num_requests": 96,
        "seed": 3,
    }
    values.update(overrides)
    return BenchConfig(**values)


def _run(mode: str, workers: int = 4, **bench: Any) -> ReplayResult:
    return run_replay(_prefix_bench(**bench), Deployment(workers, mode, engine=ENGINE))


def _stable(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in summary.items() if k not in _VOLATILE}


def _rows(result: ReplayResult) -> list[tuple[Any, ...]]:
    return [
        (f.record.start, f.record.end, f.record.ttft, tuple(f.record.itl), f.routing)
        for f in result.flights
    ]


@pytest.mark.parametrize("mode", ["kv", "random", "round-robin"])
def test_same_seed_same_report(mode: str) -> None:
    a, b = _run(mode), _run(mode)
    assert _stable(a.summary) == _stable(b.summary)
    assert _rows(a) == _rows(b)
    assert a.summary["requests"] == {"total": 96, "completed": 96, "failed": 0}


def test_round_robin_closed_loop_is_deterministic_whatever_the_seed() -> None:
    """Round-robin draws no random numbers: only the workload's seed matters."""
    a = run_replay(_prefix_bench(), Deployment(4, "round-robin", engine=ENGINE))
    b = run_replay(_prefix_bench(), Deployment(4, "round-robin", engine=ENGINE))
    workers = [f.routing.worker_id for f in a.flights if f.routing is not None]
    assert workers[:8] == [workers[i % 4] for i in range(8)]  # the cycle
    assert len(set(workers[:4])) == 4
    assert _rows(a) == _rows(b)


def test_kv_routing_beats_round_robin_on_prefix_hits() -> None:
    kv, rr = _run("kv"), _run("round-robin")
    assert kv.summary["cache_hit_rate"] > rr.summary["cache_hit_rate"] + 0.05
    # the router's predicted overlap is what the engine then found cached (events are exact)
    for f in kv.flights:
        assert f.routing is not None and f.record.cached_tokens is not None
        assert f.record.cached_tokens >= min(f.routing.overlap_blocks * 16, 320 - 1) - 16


def test_closed_loop_keeps_concurrency_requests_in_flight() -> None:
    result = _run("round-robin", concurrency=4, num_requests=40)
    starts = [(f.record.start, 1) for f in result.flights]
    events = sorted(starts + [(f.record.end, -1) for f in result.flights])
    level = peak = 0
    for _, delta in events:
        level += delta
        peak = max(peak, level)
    assert peak == 4


def test_open_loop_rate_and_duration() -> None:
    result = _run("kv", rate=20.0, num_requests=None, duration_s=2.0)
    starts = [f.record.start for f in result.flights]
    assert starts == sorted(starts) and max(starts) < 2.0
    assert 20 <= len(starts) <= 60  # Poisson at 20/s over 2 s
    assert all(f.record.ok for f in result.flights)


def test_trace_arrivals_and_hash_ids(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 64, "output_length": 4, "hash_ids": [1, 2]},
        {"timestamp": 500, "input_length": 64, "output_length": 4, "hash_ids": [1, 2]},
        {"timestamp": 1500, "input_length": 48, "output_length": 2, "hash_ids": [1]},
    ]
    trace.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    bench = BenchConfig(url="replay:", workload="trace", trace=str(trace), trace_block_size=32)
    result = run_replay(bench, Deployment(1, "kv", engine=ENGINE))
    assert [f.record.start for f in result.flights] == [0.0, 0.5, 1.5]
    assert [f.record.output_tokens for f in result.flights] == [4, 4, 2]
    # the repeat finds the prompt cached (all but the last token, computed anyway); the third
    # shares the first hash id's 32 tokens
    assert result.flights[1].record.cached_tokens == 63
    assert result.flights[2].record.cached_tokens == 32


def test_multi_turn_sessions_grow_their_context() -> None:
    bench = BenchConfig(
        url="replay:",
        workload="multi-turn",
        turns=3,
        isl=32,
        osl=8,
        concurrency=2,
        num_requests=6,
    )
    result = run_replay(bench, Deployment(2, "kv", engine=ENGINE))
    assert len(result.flights) == 6 and all(f.record.ok for f in result.flights)
    by_session: dict[int, list[int]] = {}
    for f in result.flights:
        by_session.setdefault(f.record.session, []).append(f.record.prompt_tokens or 0)
    for lengths in by_session.values():
        assert lengths == sorted(lengths) and lengths[0] == 32 and lengths[-1] > 32 + 8


def test_request_that_can_never_fit_fails_with_400() -> None:
    bench = BenchConfig(url="replay:", workload="synthetic", isl=600, osl=4, num_requests=2)
    tiny = MockerConfig(num_gpu_blocks=8, block_size=16)
    result = run_replay(bench, Deployment(1, "kv", engine=tiny))
    assert result.summary["requests"]["failed"] == 2
    assert result.summary["errors"] == {"http_400": 2}


def test_data_parallel_ranks_are_routed() -> None:
    engine = MockerConfig(num_gpu_blocks=512, block_size=16, data_parallel_size=2)
    result = run_replay(_prefix_bench(), Deployment(2, "kv", engine=engine))
    used = {(f.routing.worker_id, f.routing.dp_rank) for f in result.flights if f.routing}
    assert len(used) == 4
    assert set(result.summary["workers"]) == {f"{w:x}:{r}" for w, r in used}


def test_cli_writes_the_bench_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "report"
    code = main(
        [
            "--workers", "2", "--router-mode", "kv", "--block-size", "16",
            "--num-gpu-blocks-override", "512", "--workload", "prefix", "--prefix-groups", "4",
            "--prefix-len", "128", "--suffix-len", "32", "--osl", "8", "--concurrency", "4",
            "--num-requests", "20", "--output-dir", str(out), "--routing-records", "--no-plots",
        ]
    )  # fmt: skip
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests"]["completed"] == 20
    assert summary["server"]["deployment"]["workers"] == 2
    rows = (out / "requests.jsonl").read_text().splitlines()
    routing = [json.loads(line) for line in (out / "routing.jsonl").read_text().splitlines()]
    assert len(rows) == len(routing) == 20
    assert {r["worker_id"] for r in routing} <= {0x1000, 0x1001}
    assert "simulated" in capsys.readouterr().out


def test_cli_bad_input_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--workers", "0", "--num-requests", "1"]) == 2
    assert main(["--workload", "trace", "--trace", "/nonexistent.jsonl"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("dynamo replay: ") for line in err)


def test_queue_dispatch_is_refused_not_simulated_as_route() -> None:
    from dynamo.frontend.disagg import DisaggSettings

    with pytest.raises(ValueError, match="route only"):
        Deployment(2, prefill_workers=1, disagg=DisaggSettings(dispatch="queue"))


def test_router_seed_varies_only_the_routers_choices() -> None:
    base = _run("kv")  # the workload's seed (3) seeds the routers too
    same = run_replay(_prefix_bench(), Deployment(4, "kv", engine=ENGINE, router_seed=3))
    other = run_replay(_prefix_bench(), Deployment(4, "kv", engine=ENGINE, router_seed=4))
    assert _rows(same) == _rows(base)
    assert [f.record.group for f in other.flights] == [f.record.group for f in base.flights]
    workers = [f.routing.worker_id for f in base.flights if f.routing]
    assert [f.routing.worker_id for f in other.flights if f.routing] != workers
    assert other.summary["server"]["deployment"]["router_seed"] == 4


def test_ended_flights_keep_their_record_and_routing_only() -> None:
    """What a request sent (its prompt, its spec) is not kept once it ended: every flight of a
    finished run holds the shared placeholders, and the report's figures are all there."""
    result = _run("kv", num_requests=40)
    assert len(result.flights) == 40 and all(f.record.ok for f in result.flights)
    for f in result.flights:
        assert f.done and f.tokens == [] and f.spec.prompt is None
        assert f.routing is not None and f.record.prompt_tokens == f.record.expected_prompt_tokens
    assert len({id(f.spec) for f in result.flights}) == 1  # one placeholder, not a spec each
