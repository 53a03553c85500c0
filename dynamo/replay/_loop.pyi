"""Type stub of the native module ``dynamo.replay._loop`` (source: ``_loop.c``): the fast path
of ``Simulation._phase`` (``dynamo.native.load_optional``; the Python loop in simulator.py is
the reference, run with ``DYN_NATIVE=0`` or without the build)."""

from collections.abc import Callable, Iterator
from typing import Any

SEND: int
PASS_END: int
PASS_START: int
IDLE: int
SCHEDULED: int
BUSY: int

def run(
    sim: Any,
    queue: Any,
    timeouts: Any,
    counter: Iterator[int],
    wake: Callable[[Any], None],
    deliver: Callable[[list[tuple[Any, int]], dict[str, Any], float], list[Any] | None],
) -> int:
    """Run ``sim``'s phase to its end (the queue and the deadlines empty) exactly as
    ``Simulation._phase``'s loop with ``_pass_start`` / ``_pass_end`` does, setting ``sim.now``
    at each instant; returns the events processed. An exception from a callback propagates
    (the loop stops there)."""

def pass_seconds(timing: Any, prefill: int, context: int, decodes: int) -> float:
    """``timing.pass_seconds(prefill, context, decodes)`` of a ``TimingModel`` as the loop
    computes it in C (the same float; exposed for the test that compares them)."""

def sender(sim: Any) -> Callable[[Any, Any, Any], None]:
    """``sim._send`` for a simulation whose every send takes one path (no frontend model, no
    router queue, aggregated workers, the KV router): ``send(spec, runner, load)`` does what
    ``_send``, ``_arrive``, ``_route``, ``_sequence`` and ``_enqueue`` do there, the same calls
    in the same order (a prompt that is not a list goes to ``sim._send``)."""
