"""The KV router's cache-consistency check (beyond the reference): what the router believes a
worker rank holds, compared with what the worker's own local index holds.

Both sides summarise a rank's block set the same way (``RadixTree.digest``: a count and an
order-independent digest of the external block ids). The router compares only when both have
seen the same last event id (otherwise events are in flight and a difference would be
transient). A difference is *drift*: events the router lost without seeing a gap (a bug, a
dropped message whose id was reused, a tampered index). The router then re-reads the rank in
full from the worker's local index (a resync), and the next check shows whether that cleared it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class RankConsistency:
    """The latest check of one worker rank (the frontend's ``/health`` detail)."""

    worker_id: int
    dp_rank: int
    router_blocks: int
    worker_blocks: int
    drift_blocks: int
    last_event_id: int | None
    checked_at: float = field(default_factory=time.time)
    resyncs: int = 0

    def as_json(self) -> dict[str, object]:
        return {
            "worker_id": f"{self.worker_id:x}",
            "dp_rank": self.dp_rank,
            "router_blocks": self.router_blocks,
            "worker_blocks": self.worker_blocks,
            "drift_blocks": self.drift_blocks,
            "last_event_id": self.last_event_id,
            "checked_at": self.checked_at,
            "resyncs": self.resyncs,
        }


def drift_blocks(router: tuple[int, int], worker: tuple[int, int]) -> int:
    """How far apart two (count, digest) summaries are: 0 when equal, else the count difference
    (at least 1: same count, different blocks)."""
    if router == worker:
        return 0
    return max(1, abs(router[0] - worker[0]))
