"""One request's way through the replay (``Flight``): what the simulator keeps per request,
and what the report reads back (its bench record and its routing decision); a run's result
(``SimulationResult``: its flights and figures)."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from dynamo.bench.request import RequestRecord, RequestSpec

if TYPE_CHECKING:  # the simulator's own types: only named here
    from dynamo.replay.load import LoadGenerator, Runner
    from dynamo.replay.pools import Rank, RoutingRecord
    from dynamo.router.queue import Held


class Flight(msgspec.Struct):
    """One request through the simulation: its bench record and its routing. A Struct: one
    is made per request, and its C ``__init__`` costs a fraction of a dataclass's."""

    index: int
    request_id: str
    record: RequestRecord
    spec: RequestSpec
    runner: Runner
    load: LoadGenerator  # the phase that sent it
    tokens: list[int] | array[int]  # the prompt, until the request ends (then emptied)
    routing: RoutingRecord | None = None
    last_token_at: float = 0.0
    rank: Rank | None = None  # where its sequence is queued or runs now
    decode_rank: Rank | None = None  # disaggregated: where the decode runs after the prefill
    done: bool = False
    held: Held[Flight] | None = None  # waiting in the router queue (--router-queue-threshold)
    hashes: tuple[list[int], list[int]] | None = None  # its prompt's hashes, while held


@dataclass(slots=True)
class SimulationResult:
    """``flights``: the measured requests, their times from the measured phase's start (after
    the warm-up: ``warmup_s`` of simulated time, whose requests are not reported)."""

    flights: list[Flight]
    simulated_s: float
    wall_s: float
    passes: int
    events: int = 0
    per_rank_passes: dict[str, int] = field(default_factory=dict)
    warmup_s: float = 0.0
