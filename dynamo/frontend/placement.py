"""Where a migrated continuation goes (issue 13): the instance where it starts soonest.

A continuation (the prompt and the tokens already sent, prefilled again) waits on its new
instance for the pass in progress there. A decode pass is short; a new request's prefill pass is
several times longer (its fixed cost), and it runs, or is queued, from the moment this frontend
dispatches the request until its first token comes back. So a continuation avoids an instance
with such a prefill pending when another candidate has none. Continuations do not count
against each other: those of one failure (one instance's streams, failing together) reach their
new instances within a millisecond or two and share the next prefill pass there.

Among the candidates left:

* the KV router decides by its cost, as for any request: prefix overlap, prefill and decode load,
  counting the continuations it has just placed;
* the round-robin and random routers know no load: a continuation goes to the instance with the
  fewest of this frontend's active streams (ties: the router's own order among them). Normal
  requests stay round-robin (random): only continuations are placed by load.

A request pinned to an instance (``nvext.backend_instance_id``) goes where it is pinned.
"""

from __future__ import annotations

from dynamo.protocol.model_card import ModelCard
from dynamo.protocol.request import PreprocessedRequest
from dynamo.router.basic import Router
from dynamo.router.kv_router import KVRouter


class InstanceStreams:
    """This frontend's streams per instance of one model: every dispatched attempt until it
    ends, and the new requests among them still waiting for their first token. Fed by the
    attempts' :class:`~dynamo.frontend.attempt.Load`; counts drop to nothing (the entry goes)
    so departed instances leave no trace."""

    __slots__ = ("active", "prefilling")

    def __init__(self) -> None:
        self.active: dict[int, int] = {}
        self.prefilling: dict[int, int] = {}

    def dispatched(self, instance_id: int, new_request: bool) -> None:
        _add(self.active, instance_id, 1)
        if new_request:
            _add(self.prefilling, instance_id, 1)

    def first_token(self, instance_id: int) -> None:
        """A new request's prefill is over (call once, and only for a new request)."""
        _add(self.prefilling, instance_id, -1)

    def ended(self, instance_id: int, prefilling: bool) -> None:
        """The attempt ended; ``prefilling``: a new request that never had its first token."""
        _add(self.active, instance_id, -1)
        if prefilling:
            _add(self.prefilling, instance_id, -1)


def _add(counts: dict[int, int], key: int, delta: int) -> None:
    n = counts.get(key, 0) + delta
    if n > 0:
        counts[key] = n
    else:
        counts.pop(key, None)


def continuation_candidates(
    router: Router,
    request: PreprocessedRequest,
    live: list[ModelCard],
    streams: InstanceStreams,
) -> list[ModelCard]:
    """The candidates the router chooses a continuation among (the module docstring)."""
    hints = request.routing
    if len(live) < 2 or (hints is not None and hints.backend_instance_id is not None):
        return live
    prefilling = streams.prefilling
    free = [c for c in live if c.instance_id not in prefilling]
    pool = free or live
    if isinstance(router, KVRouter):
        return pool
    active = streams.active
    least = min(active.get(c.instance_id, 0) for c in pool)
    return [c for c in pool if active.get(c.instance_id, 0) == least]
