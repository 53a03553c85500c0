"""One request's way through the replay (``Flight``): what the simulator keeps per request,
and what the report reads back (its bench record and its routing decision)."""

from __future__ import annotations

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
    tokens: list[int]  # the prompt, until the request ends (then emptied: memory)
    routing: RoutingRecord | None = None
    last_token_at: float = 0.0
    rank: Rank | None = None  # where its sequence is queued or runs now
    decode_rank: Rank | None = None  # disaggregated: where the decode runs after the prefill
    done: bool = False
    held: Held[Flight] | None = None  # waiting in the router queue (--router-queue-threshold)
    hashes: tuple[list[int], list[int]] | None = None  # its prompt's hashes, while held
