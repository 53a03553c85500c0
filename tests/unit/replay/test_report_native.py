"""replay/_report.c against its fallback (the definition): the same records, window and worker
totals of a replay's flights, with failures, unrouted requests and usage left out; and the
cases the native module hands back to the fallback."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from types import ModuleType

import msgspec
import pytest

from dynamo.bench.config import BenchConfig
from dynamo.mocker.config import MockerConfig
from dynamo.replay import _report_fallback as py
from dynamo.replay.deployment import Deployment
from dynamo.replay.flight import Flight
from dynamo.replay.pools import RoutingRecord
from dynamo.replay.report import flight_figures, worker_summary
from dynamo.replay.run import run_replay

replace = msgspec.structs.replace


@pytest.fixture(scope="module")
def native() -> ModuleType:
    return pytest.importorskip("dynamo.replay._report")


@pytest.fixture(scope="module")
def flights() -> list[Flight]:
    """A small KV-routed replay's flights, over two workers of two DP ranks each."""
    bench = BenchConfig(
        url="replay:",
        workload="prefix",
        prefix_groups=4,
        prefix_len=64,
        suffix_len=16,
        osl=4,
        concurrency=8,
        num_requests=80,
        seed=2,
    )
    engine = MockerConfig(num_gpu_blocks=128, block_size=16, data_parallel_size=2)
    return run_replay(bench, Deployment(2, "kv", engine=engine)).flights


def mixed(flights: list[Flight], seed: int) -> list[Flight]:
    """Copies of the flights, some failed, unrouted, without usage or cached tokens, on more
    workers (ids past 32 bits included), their ends shuffled (ties included)."""
    rng = random.Random(seed)
    out = []
    for f in flights:
        record = replace(f.record, end=rng.choice([f.record.end, 1.5, 2.5]))
        routing = f.routing
        kind = rng.randrange(6)
        if kind == 0:
            record.error = "timeout"
        elif kind == 1:
            routing = None
        elif kind == 2:
            record.prompt_tokens = None
            record.cached_tokens = None
        elif kind == 3 and routing is not None:
            routing = replace(routing, worker_id=rng.choice([7, 2**40 + 3]), dp_rank=1)
        out.append(replace(f, record=record, routing=routing))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_flight_figures_are_the_definitions(
    native: ModuleType, flights: list[Flight], seed: int
) -> None:
    rows = mixed(flights, seed) if seed else flights
    got, want = native.flight_figures(rows), py.flight_figures(rows)
    assert got is not None
    assert all(a is b for a, b in zip(got[0], want[0], strict=True))  # the records themselves
    assert got[1] is want[1]  # the same float object: max keeps the first of the largest
    assert list(got[2].items()) == list(want[2].items())  # the workers in the same order
    assert native.flight_figures([]) == py.flight_figures([]) == ([], 0.0, {})


class _Routing(RoutingRecord):
    pass


def _odd_routing(f: Flight) -> Flight:
    assert f.routing is not None
    return replace(f, routing=replace(f.routing, worker_id=1.0))


@pytest.mark.parametrize(
    "odd",
    [
        lambda f: replace(f, record=replace(f.record, end=1)),  # an int end
        lambda f: replace(f, record=replace(f.record, prompt_tokens=2**64)),
        lambda f: replace(f, record=replace(f.record, cached_tokens=True)),
        _odd_routing,
        lambda f: replace(f, routing=_Routing(1, 0)),  # not exactly a RoutingRecord
    ],
)
def test_odd_flights_defer_to_the_definition(
    native: ModuleType, flights: list[Flight], odd: Callable[[Flight], Flight]
) -> None:
    rows = list(flights)
    rows[5] = odd(rows[5])
    assert native.flight_figures(rows) is None
    want = py.flight_figures(rows)
    got = flight_figures(rows)
    assert got[0] == want[0] and got[1] == want[1] and got[2] == want[2]


def test_totals_past_64_bits_defer(native: ModuleType, flights: list[Flight]) -> None:
    routed = [f for f in flights if f.routing is not None and f.record.ok]
    rows = [replace(f, record=replace(f.record, prompt_tokens=2**62)) for f in routed[:4]]
    assert rows[0].routing is not None
    one = rows[0].routing
    rows = [replace(f, routing=RoutingRecord(one.worker_id, one.dp_rank)) for f in rows]
    assert native.flight_figures(rows) is None
    assert py.flight_figures(rows)[2][(one.worker_id, one.dp_rank)][1] == 4 * 2**62
    with pytest.raises(TypeError):
        native.flight_figures(tuple(flights))


def test_worker_summary_rows(flights: list[Flight]) -> None:
    rows = worker_summary(flights)
    assert list(rows) == sorted(rows) and len(rows) == 4  # two workers, two ranks each
    ok = [f for f in flights if f.routing is not None and f.record.ok]
    assert sum(row["requests"] for row in rows.values()) == len(ok)
    for row in rows.values():
        assert row["hit_rate"] == row["cached_tokens"] / row["prompt_tokens"]
    assert not math.isnan(flight_figures(flights)[1])


def test_many_workers_keep_their_first_met_order(native: ModuleType, flights: list[Flight]) -> None:
    """Past the native table's first room (8 workers) and its growth, in first-met order."""
    rng = random.Random(8)
    rows = []
    for f in flights * 3:
        routing = RoutingRecord(rng.randrange(40) << 20, rng.randrange(3))
        rows.append(replace(f, routing=routing))
    got, want = native.flight_figures(rows), py.flight_figures(rows)
    assert got is not None and len(want[2]) > 60
    assert list(got[2].items()) == list(want[2].items())
