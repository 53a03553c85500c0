"""Load shedding: a model admits as many requests as its serving workers can hold.

A worker advertises what it runs at once in its model card (``max_num_seqs``); a model admits
``factor`` x the sum over its serving workers (factor 2: each worker's running batch plus as
many waiting). A request past that is refused at once (529, or 503 with ``--overload-status``)
with a ``Retry-After`` from the current drain rate: how long, at the rate this model's requests
finished over the last ``window_s``, until enough finish for one more to fit. A model whose
workers advertise no capacity is not shed.

The ticket an admitted request gets is released exactly once, by its owner
(``InflightRequest.finish``).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterable

from dynamo.protocol.model_card import ModelCard
from dynamo.runtime.errors import Overloaded

DRAIN_WINDOW_S = 10.0
MAX_RETRY_AFTER_S = 60


class Shed(Overloaded):
    """A request refused by load shedding; ``retry_after_s`` goes to the Retry-After header."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Ticket:
    """One admitted request's place in its model's budget."""

    __slots__ = ("_model", "_released")

    def __init__(self, model: _ModelLoad) -> None:
        self._model = model
        self._released = False

    def release(self) -> None:
        """Give the place back (idempotent) and count a finished request for the drain rate."""
        if self._released:
            return
        self._released = True
        self._model.admitted -= 1
        self._model.finished_at.append(time.monotonic())


class _ModelLoad:
    __slots__ = ("admitted", "finished_at")

    def __init__(self) -> None:
        self.admitted = 0
        self.finished_at: deque[float] = deque(maxlen=100_000)


class Admission:
    """Per-model admission against advertised capacity. ``factor`` 0 disables shedding."""

    def __init__(self, factor: float = 2.0, window_s: float = DRAIN_WINDOW_S) -> None:
        self._factor = factor
        self._window_s = window_s
        self._models: dict[str, _ModelLoad] = {}

    @staticmethod
    def capacity(cards: Iterable[ModelCard]) -> int | None:
        """What the workers of ``cards`` run at once, or None when one does not say."""
        total = 0
        for card in cards:
            if card.max_num_seqs is None:
                return None
            total += card.max_num_seqs
        return total

    def admit(self, model: str, cards: Iterable[ModelCard]) -> Ticket:
        """A ticket for one request of ``model``, or :class:`Shed` when it is full."""
        load = self._models.get(model)
        if load is None:
            load = self._models[model] = _ModelLoad()
        capacity = self.capacity(cards)
        if self._factor > 0 and capacity is not None:
            limit = max(1, math.floor(capacity * self._factor))
            if load.admitted >= limit:
                wait = self.retry_after(load, load.admitted - limit + 1)
                raise Shed(
                    f"model {model!r} is at capacity ({limit} requests in flight); "
                    f"retry after {wait} s",
                    wait,
                )
        load.admitted += 1
        return Ticket(load)

    def admitted(self, model: str) -> int:
        load = self._models.get(model)
        return 0 if load is None else load.admitted

    def retry_after(self, load: _ModelLoad, needed: int) -> int:
        """Seconds until ``needed`` requests finish at the recent drain rate (1..60)."""
        now = time.monotonic()
        recent = load.finished_at
        while recent and now - recent[0] > self._window_s:
            recent.popleft()
        if not recent:  # nothing finished lately: requests are long; come back in a window
            return min(MAX_RETRY_AFTER_S, math.ceil(self._window_s))
        span = max(now - recent[0], 1.0)
        rate = len(recent) / span
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(needed / rate)))
