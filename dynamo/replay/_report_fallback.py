"""The pure-Python twin of ``dynamo.replay._report`` (the same contract: ``_report.pyi``);
``dynamo.replay.report`` picks one. This pass is the definition the native module follows."""

from __future__ import annotations

from typing import Any

WorkerTotals = dict[tuple[int, int], list[int]]
"""Per ``(worker_id, dp_rank)``: ``[requests, prompt tokens, cached tokens]``."""


def flight_figures(flights: list[Any]) -> tuple[list[Any], float, WorkerTotals]:
    """The flights' records in order, the last end among them (``max``: 0.0 for none), and
    the totals of each worker's routed requests that completed (``prompt_tokens or 0``,
    ``cached_tokens or 0``), the workers in the order their first such request comes. Always
    an answer (the native module's None: "the twin's case")."""
    records = [f.record for f in flights]
    window = max((r.end for r in records), default=0.0)
    totals: WorkerTotals = {}
    for f in flights:
        routing, record = f.routing, f.record
        if routing is None or record.error is not None:  # routed and ok
            continue
        key = (routing.worker_id, routing.dp_rank)
        row = totals.get(key)
        if row is None:
            row = totals[key] = [0, 0, 0]
        row[0] += 1
        row[1] += record.prompt_tokens or 0
        row[2] += record.cached_tokens or 0
    return records, window, totals
