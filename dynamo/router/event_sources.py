"""Workers the KV router expects KV events from but that cannot provide them (the reference's
``router_kv_event_source_mismatch_workers``).

A KV router that follows KV events (``--router-use-kv-events``, the default) relies on each
worker's ``kv_recovery`` endpoint, the query endpoint of the worker-local index: recovery after
an event gap, the first read of a worker that joins, and the cache-consistency check
(``consistency.py``) all ask it. A worker whose card is routed to but whose ``kv_recovery``
instance is not in discovery can publish events the router never repairs or checks: its share
of the index silently decays, and cache-aware routing with it. The reference counts such
workers per router; so do we, from the router's worker set and its ``kv_recovery`` client's
live instances (both read from discovery, never assumed). As the reference does, a worker that
explicitly disabled KV event publishing (its card's ``kv_events`` false: vLLM's
``--no-kv-events``) counts too: the router would index nothing of its cache.

A worker registers its card before it serves ``kv_recovery`` (the backend serves it once
registered), so a worker counts only after ``GRACE_S`` without it, as in the reference (one
that disabled its events says so in its card: it counts at once). The router logs an error when
a worker starts counting (again every ``REPEAT_S`` while it does) and an info line when it
stops.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field

from dynamo.protocol.model_card import ModelCard

log = logging.getLogger(__name__)

GRACE_S = 10.0  # the reference's registration grace period
REPEAT_S = 60.0  # the reference's repeat interval of the error
INTERVAL_S = 1.0  # the reference's health-check interval


@dataclass(frozen=True, slots=True)
class SourceCheck:
    """One evaluation: the workers missing their query endpoint past the grace (sorted), those
    to report now (newly, or again after ``REPEAT_S``) and those that stopped missing it."""

    mismatched: list[int]
    report: list[int]
    recovered: list[int]


@dataclass(slots=True)
class EventSourceMonitor:
    """One KV router's check: :meth:`evaluate` is pure (the caller gives the time and both
    sides) and remembers when each worker was first seen missing its endpoint and when it was
    last reported; :meth:`watch` is the router's task that evaluates every ``interval_s``."""

    model: str
    grace_s: float = GRACE_S
    interval_s: float = INTERVAL_S
    repeat_s: float = REPEAT_S
    _missing_since: dict[int, float] = field(default_factory=dict)
    _reported_at: dict[int, float] = field(default_factory=dict)

    def evaluate(
        self,
        now: float,
        expected: Iterable[int],
        queryable: Collection[int],
        silent: Collection[int] = (),
    ) -> SourceCheck:
        """``expected``: the workers the router expects KV events from; ``queryable``: those
        with a live ``kv_recovery`` instance; ``silent``: those that disabled KV events."""
        expected = set(expected)
        missing = {w for w in expected if w not in queryable}
        for worker in list(self._missing_since):
            if worker not in missing:
                del self._missing_since[worker]
        for worker in missing:
            self._missing_since.setdefault(worker, now)
        late = {w for w, t in self._missing_since.items() if now - t >= self.grace_s}
        mismatched = sorted(late | (expected & set(silent)))
        matured = set(mismatched)
        recovered = sorted(w for w in self._reported_at if w not in matured)
        for worker in recovered:
            del self._reported_at[worker]
        report = []
        for worker in mismatched:
            last = self._reported_at.get(worker)
            if last is None or now - last >= self.repeat_s:
                self._reported_at[worker] = now
                report.append(worker)
        return SourceCheck(mismatched, report, recovered)

    async def watch(
        self,
        expected: Mapping[int, ModelCard],
        queryable: Callable[[], Iterable[int]],
        publish: Callable[[int], None] | None,
    ) -> None:
        """Evaluate until cancelled. ``expected``: a live view of the cards of the workers the
        router expects KV events from (read anew each time); ``queryable()``: the workers with
        a live ``kv_recovery`` instance. ``publish`` gets the count of mismatched workers (0
        once cancelled: a closed router expects nothing); reports are logged."""
        try:
            while True:
                disabled = {worker for worker, card in expected.items() if not card.kv_events}
                check = self.evaluate(time.monotonic(), expected, set(queryable()), disabled)
                if publish is not None:
                    publish(len(check.mismatched))
                for worker in check.report:
                    if worker in disabled:
                        log.error(
                            "KV event routing degraded for %r: worker %x publishes no KV events "
                            "(disabled); the router indexes nothing of its cache",
                            self.model,
                            worker,
                        )
                        continue
                    log.error(
                        "KV event routing degraded for %r: worker %x has no kv_recovery "
                        "endpoint after %gs; its events cannot be recovered after a gap nor "
                        "checked, and cache-aware routing to it decays (a worker without a "
                        "local KV index?)",
                        self.model,
                        worker,
                        self.grace_s,
                    )
                for worker in check.recovered:
                    log.info(
                        "worker %x of %r no longer lacks kv_recovery (served, or gone)",
                        worker,
                        self.model,
                    )
                await asyncio.sleep(self.interval_s)
        finally:
            if publish is not None:
                publish(0)
