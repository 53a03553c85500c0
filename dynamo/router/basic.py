"""The router seam, and the basic policies: round-robin, random and direct.

A router picks one (instance, DP rank) among a model's live candidates for each request, and
hears about the request's progress (first token, end) so it can keep load accounting. The
frontend's model registry creates a model's router when the model's first worker of a role
appears, tells it about every worker that joins or leaves (from the discovery watch, so a KV
router indexes a worker's events from its first one), and closes it when the model retires.
Routers are driven by one task (the frontend's event loop) and are not thread-safe.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from dynamo.protocol.model_card import ModelCard
from dynamo.protocol.request import PreprocessedRequest
from dynamo.runtime.errors import NoInstances

if TYPE_CHECKING:
    from dynamo.observability.router_metrics import RouterRequestSeries
    from dynamo.router.waiting import RouterQueue


@dataclass(frozen=True, slots=True)
class Selection:
    instance_id: int
    dp_rank: int | None = None
    overlap_blocks: int = 0
    cost: float | None = None  # the KV router's cost of the choice (lower is better)


class Router(Protocol):
    queue: RouterQueue | None
    """Requests held for capacity (``--router-queue-threshold``; KV routers only), or None."""
    series: RouterRequestSeries | None
    """The ``dynamo_component_router_*`` series this router's requests feed, or None."""

    def select(self, request: PreprocessedRequest, candidates: Sequence[ModelCard]) -> Selection:
        """Pick a target; raise NoInstances (none live) or Overloaded (all busy)."""
        ...

    def on_first_token(self, request_id: str) -> None: ...

    def on_finish(self, request_id: str) -> None:
        """The request ended (completed, failed or cancelled): free its load. Idempotent."""
        ...

    def add_worker(self, card: ModelCard) -> None:
        """A worker of the model joined (its card appeared in discovery)."""
        ...

    def remove_worker(self, instance_id: int) -> None:
        """A worker left: forget its index and load."""
        ...

    async def close(self) -> None:
        """The model retired: stop background work (event following, sync)."""
        ...


class _Stateless:
    """The lifecycle of a router that keeps no per-worker state (no queue, no series)."""

    queue: RouterQueue | None = None
    series: RouterRequestSeries | None = None

    def on_first_token(self, request_id: str) -> None:
        pass

    def on_finish(self, request_id: str) -> None:
        pass

    def add_worker(self, card: ModelCard) -> None:
        pass

    def remove_worker(self, instance_id: int) -> None:
        pass

    async def close(self) -> None:
        pass


def pinned(request: PreprocessedRequest, candidates: Sequence[ModelCard]) -> Selection | None:
    """Direct routing: the request names its instance (nvext.backend_instance_id)."""
    hints = request.routing
    if hints is None or hints.backend_instance_id is None:
        return None
    for card in candidates:
        if card.instance_id == hints.backend_instance_id:
            return Selection(card.instance_id, hints.dp_rank)
    raise NoInstances(f"instance {hints.backend_instance_id} is not a live worker of this model")


class RoundRobinRouter(_Stateless):
    def __init__(self) -> None:
        self._next = 0

    def select(self, request: PreprocessedRequest, candidates: Sequence[ModelCard]) -> Selection:
        direct = pinned(request, candidates)
        if direct is not None:
            return direct
        if not candidates:
            raise NoInstances("no live instance")
        idx = self._next % len(candidates)
        self._next = idx + 1
        return Selection(candidates[idx].instance_id)


class RandomRouter(_Stateless):
    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def select(self, request: PreprocessedRequest, candidates: Sequence[ModelCard]) -> Selection:
        direct = pinned(request, candidates)
        if direct is not None:
            return direct
        if not candidates:
            raise NoInstances("no live instance")
        return Selection(candidates[self._rng.randrange(len(candidates))].instance_id)
