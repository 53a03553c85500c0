"""replay/_deliver.c against its Python twin (``_deliver_fallback.py``): the same records (TTFT,
ITL gaps, token counts, last-token times) and the same first-token flights for random passes
over the replay's own slotted classes and over plain classes (the getattr path), requests
abandoned between passes, and the same errors; no reference leaked."""

from __future__ import annotations

import copy
import random
import sys
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import pytest

from dynamo.bench.request import RequestRecord
from dynamo.replay import _deliver_fallback as py


@pytest.fixture(scope="module")
def native() -> ModuleType:
    return pytest.importorskip("dynamo.replay._deliver")


@pytest.fixture(params=["native", "fallback"])
def impl(request: pytest.FixtureRequest, native: ModuleType) -> ModuleType:
    return native if request.param == "native" else py


@dataclass(slots=True)
class SlotSeq:
    request_id: str


@dataclass(slots=True)
class SlotFlight:  # the fields the delivery reads, as the simulator's Flight holds them
    record: RequestRecord
    last_token_at: float = 0.0


class PlainSeq:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id


class PlainRecord:
    def __init__(self, start: float) -> None:
        self.start = start
        self.ttft: float | None = None
        self.itl: list[float] = []
        self.output_tokens = 0


@dataclass
class PlainFlight:
    record: Any
    last_token_at: float = 0.0
    extra: list[int] = field(default_factory=list)


def _world(rng: random.Random, plain: bool, n: int) -> tuple[list[Any], list[Any]]:
    seqs: list[Any] = []
    flights: list[Any] = []
    for i in range(n):
        start = rng.random() * 5
        if plain:
            seqs.append(PlainSeq(f"r{i}"))
            flights.append(PlainFlight(PlainRecord(start)))
        else:
            seqs.append(SlotSeq(f"r{i}"))
            flights.append(
                SlotFlight(RequestRecord(start=start, max_tokens=8, expected_prompt_tokens=4))
            )
    return seqs, flights


def _state(flights: list[Any]) -> list[tuple[Any, ...]]:
    return [
        (f.record.ttft, list(f.record.itl), f.record.output_tokens, f.last_token_at)
        for f in flights
    ]


@pytest.mark.parametrize("plain", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_same_records_as_the_twin(native: ModuleType, seed: int, plain: bool) -> None:
    """Random passes (1-12 tokens from a pool of requests, some abandoned: not in ``by_id``):
    after every pass both implementations leave the same records and return the same
    first-token flights (by identity, in order)."""
    rng = random.Random(seed)
    seqs, flights = _world(rng, plain, 40)
    twin_flights = copy.deepcopy(flights)
    by_id = {s.request_id: f for s, f in zip(seqs, flights, strict=True)}
    twin_by_id = {s.request_id: f for s, f in zip(seqs, twin_flights, strict=True)}
    now = 5.0
    for _ in range(300):
        now += rng.choice([0.0, 0.001, rng.random() * 0.05])
        tokens = [(rng.choice(seqs), rng.randrange(1000)) for _ in range(rng.randrange(13))]
        got = native.deliver(tokens, by_id, now)
        want = py.deliver(tokens, twin_by_id, now)
        if want is None:
            assert got is None
        else:
            assert got is not None
            assert [flights.index(f) for f in got] == [twin_flights.index(f) for f in want]
        assert _state(flights) == _state(twin_flights)
        if rng.random() < 0.1:  # a request abandoned (or finished) between passes
            rid = rng.choice(seqs).request_id
            by_id.pop(rid, None)
            twin_by_id.pop(rid, None)
    assert sum(f.record.output_tokens for f in flights) > 0


def test_first_token_then_gaps(impl: ModuleType) -> None:
    record = RequestRecord(start=1.0, max_tokens=4, expected_prompt_tokens=2)
    flight = SlotFlight(record)
    seq = SlotSeq("a")
    assert impl.deliver([(seq, 7)], {"a": flight}, 1.5) == [flight]
    assert impl.deliver([(seq, 8)], {"a": flight}, 1.75) is None
    assert impl.deliver([(seq, 9)], {}, 2.0) is None  # abandoned: untouched
    assert (record.ttft, record.itl, record.output_tokens) == (0.5, [0.25], 2)
    assert flight.last_token_at == 1.75
    assert impl.deliver([], {"a": flight}, 3.0) is None


def test_gaps_from_one_instant_share_one_float(impl: ModuleType) -> None:
    """Requests whose previous token came at the same instant (stored as one object) get gaps
    of the same value; the native module hands them one float object (the twin, equal ones)."""
    records = [RequestRecord(start=0.0, max_tokens=4, expected_prompt_tokens=2) for _ in range(4)]
    flights = [SlotFlight(r) for r in records]
    seqs = [SlotSeq(str(i)) for i in range(4)]
    by_id = {s.request_id: f for s, f in zip(seqs, flights, strict=True)}
    impl.deliver([(s, 1) for s in seqs[:3]], by_id, 0.5)  # three first tokens at 0.5
    impl.deliver([(seqs[3], 1)], by_id, 0.7)  # the fourth's at 0.7
    impl.deliver([(s, 2) for s in seqs], by_id, 1.1)
    gaps = [r.itl[0] for r in records]
    assert gaps == [1.1 - 0.5] * 3 + [1.1 - 0.7]
    if impl is not py:
        assert gaps[0] is gaps[1] is gaps[2] and gaps[3] is not gaps[0]


def test_errors(impl: ModuleType) -> None:
    with pytest.raises((TypeError, ValueError)):
        impl.deliver([(SlotSeq("a"), 1, 2)], {}, 1.0)
    with pytest.raises(TypeError):
        impl.deliver([object()], {}, 1.0)
    broken = PlainFlight(object())  # a record without the fields
    with pytest.raises(AttributeError):
        impl.deliver([(PlainSeq("a"), 1)], {"a": broken}, 1.0)
    with pytest.raises(AttributeError):
        impl.deliver([(object(), 1)], {}, 1.0)


def test_no_reference_leaked(native: ModuleType) -> None:
    """Many passes leave the refcounts of the shared objects where they were."""
    record = RequestRecord(start=0.0, max_tokens=4, expected_prompt_tokens=2)
    flight = SlotFlight(record)
    seq = SlotSeq("a")
    by_id = {"a": flight}
    now = 1.0
    native.deliver([(seq, 1)], by_id, now)  # the first token (and the classes learned)
    before = (sys.getrefcount(flight), sys.getrefcount(seq), sys.getrefcount(now))
    for _ in range(1000):
        native.deliver([(seq, 1), (SlotSeq("gone"), 2)], by_id, now)
    record.itl.clear()
    after = (sys.getrefcount(flight), sys.getrefcount(seq), sys.getrefcount(now))
    assert after == before
