"""Type stub of the native module ``dynamo.replay._report`` (source: ``_report.c``; the same
contract in Python: ``_report_fallback.py``). Import through ``dynamo.replay.report``."""

from typing import Any

def flight_figures(
    flights: list[Any],
) -> tuple[list[Any], float, dict[tuple[int, int], list[int]]] | None:
    """The flights' records in order, the last end among them (``max``: the first of the
    largest; 0.0 for none), and per ``(worker_id, dp_rank)`` of the routed requests that
    completed ``[requests, prompt_tokens or 0, cached_tokens or 0]`` summed, the workers in
    the order their first such request comes. The twin's answer, or None where this
    implementation cannot promise it (a flight, record or routing not exactly a ``Flight``,
    ``RequestRecord`` or ``RoutingRecord``; an end that is not an exact float; a count or id
    that is not None / an exact int within 64 bits; a total past 64 bits). TypeError if
    ``flights`` is not a list."""
