"""replay/_events.c against its heapq twin (``_events_fallback.py``): the same events out in the
same order for random pushes and pops full of ties, the same errors, and payloads kept alive
(and collected in cycles) as the queue holds them."""

from __future__ import annotations

import gc
import math
import random
import weakref
from types import ModuleType

import pytest

from dynamo.replay import _events_fallback as py


@pytest.fixture(scope="module")
def native() -> ModuleType:
    return pytest.importorskip("dynamo.replay._events")


@pytest.fixture(params=["native", "fallback"])
def impl(request: pytest.FixtureRequest, native: ModuleType) -> ModuleType:
    return native if request.param == "native" else py


@pytest.mark.parametrize("seed", range(8))
def test_same_order_as_the_heapq_twin(native: ModuleType, seed: int) -> None:
    """Interleaved pushes and pops with many equal times and kinds (the replay's ties: pass
    ends and starts at one instant), orders from a FIFO counter: both queues give the same
    (when, kind, payload) sequence and the same next time at every step."""
    rng = random.Random(seed)
    a, b = native.EventQueue(), py.EventQueue()
    order, now = 0, 0.0
    for _ in range(3000):
        if rng.random() < 0.55 or not len(a):
            when = now + rng.choice([0.0, 0.0, 0.5, rng.random() * 3])
            kind = rng.randrange(3)
            payload = object() if rng.random() < 0.5 else None
            a.push(when, kind, order, payload)
            b.push(when, kind, order, payload)
            order += 1
        else:
            got, want = a.pop(), b.pop()
            assert got[0] == want[0] and got[1] == want[1] and got[2] is want[2]
            now = got[0]
        assert len(a) == len(b)
        assert a.next_when() == b.next_when()
    while len(b):
        assert a.pop()[2] is b.pop()[2]
    assert len(a) == 0


def test_contract(impl: ModuleType) -> None:
    q = impl.EventQueue()
    assert len(q) == 0 and q.next_when() == math.inf
    with pytest.raises(IndexError):
        q.pop()
    with pytest.raises(ValueError, match="NaN"):
        q.push(math.nan, 0, 0, None)
    with pytest.raises(TypeError):
        q.push("soon", 0, 0, None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        q.push(1.0, 0.5, 0, None)  # type: ignore[arg-type]
    q.push(2, 1, 5, "int time")  # an int time is its float
    q.push(2.0, 0, 9, "lower kind first")
    q.push(1.5, 2, 7, "earliest")
    assert q.next_when() == 1.5
    assert [q.pop() for _ in range(3)] == [
        (1.5, 2, "earliest"),
        (2.0, 0, "lower kind first"),
        (2.0, 1, "int time"),
    ]
    assert len(q) == 0


def test_payloads_are_held_and_collected(impl: ModuleType) -> None:
    class Box:
        pass

    q = impl.EventQueue()
    box = Box()
    ref = weakref.ref(box)
    q.push(0.0, 0, 0, box)
    del box
    gc.collect()
    assert ref() is not None  # the queue holds it
    q.pop()
    gc.collect()
    assert ref() is None  # popped and dropped: freed
    cyclic = Box()
    cyclic.queue = q  # type: ignore[attr-defined]
    q.push(1.0, 0, 1, cyclic)
    ref = weakref.ref(cyclic)
    del cyclic, q
    gc.collect()
    assert ref() is None  # a queue in a cycle with its payload is collected
