"""Routing targets as (worker_id, dp_rank) keys, and the small-int slots the prefix trees use."""

from __future__ import annotations

WorkerKey = tuple[int, int]
"""A routing target: (worker_id, dp_rank)."""


class SlotMap:
    """Allocates small-int slots for worker keys and maps them back (freed slots are reused)."""

    __slots__ = ("_slot_of", "_key_of", "_free")

    def __init__(self) -> None:
        self._slot_of: dict[WorkerKey, int] = {}
        self._key_of: list[WorkerKey] = []
        self._free: list[int] = []

    def get(self, key: WorkerKey) -> int | None:
        return self._slot_of.get(key)

    def slot(self, key: WorkerKey) -> int:
        """The key's slot, allocated on first use."""
        s = self._slot_of.get(key)
        if s is None:
            if self._free:
                s = self._free.pop()
                self._key_of[s] = key
            else:
                s = len(self._key_of)
                self._key_of.append(key)
            self._slot_of[key] = s
        return s

    def release(self, key: WorkerKey) -> int | None:
        s = self._slot_of.pop(key, None)
        if s is not None:
            self._free.append(s)
        return s

    def keys(self) -> list[WorkerKey]:
        return list(self._slot_of)

    def key_list(self) -> list[WorkerKey]:
        """slot -> key, live (the slots' own list: read it, never change it; a released slot
        keeps its last key until it is reused)."""
        return self._key_of

    def to_keys(self, scores: dict[int, int]) -> dict[WorkerKey, int]:
        """Re-key per-slot scores by worker key (every slot in ``scores`` must be live)."""
        key_of = self._key_of
        return {key_of[s]: d for s, d in scores.items()}
