"""The replay's model of the frontend's own time a request (``Deployment.frontend_ms``).

A live frontend parses, hashes and routes on one event loop, so a burst of sends reaches the
router spread out, one request after another; the requests of a burst's tail are then routed
with the KV events of its head's prefills already in the index (a closed loop's first wave:
the live hit rate is higher than an instant router's). The model: a FIFO server with a fixed
service time a request, in send order, on the virtual clock.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dynamo.replay.flight import Flight


class FrontendModel:
    """When each sent request reaches the router."""

    def __init__(self, frontend_ms: float) -> None:
        self.seconds = frontend_ms / 1000.0
        self._free = 0.0  # when the frontend is done with its last request

    def reaches_router(self, sent: float) -> float:
        """The time a request sent at ``sent`` reaches the router (after the ones before it)."""
        at = max(sent, self._free) + self.seconds
        self._free = at
        return at


def wake_or_arrive(
    wake: Callable[[Any], None], arrive: Callable[[Flight], None]
) -> Callable[[object], None]:
    """The send events' handler when the frontend is modelled: an event is a runner's (or the
    open loop's) wake, or a flight the frontend hands to the router now (``arrive``; not one
    that timed out meanwhile)."""

    def on_send(payload: object) -> None:
        if isinstance(payload, Flight):
            if not payload.done:
                arrive(payload)
        else:
            wake(payload)

    return on_send
