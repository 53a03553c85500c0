"""``StopStrings``: finding stop strings in streamed text, and what to hold back meanwhile.

Pure string logic, used by the incremental detokenizer once per chunk of generated text.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# Above this many characters of proper prefixes (stop strings longer than ~180 characters) the
# prefix table would cost too much memory per request; fall back to a scan that needs none.
_MAX_PREFIX_CHARS = 16_384


class StopStrings:
    """A request's stop strings (empty strings are ignored). Immutable.

    ``find`` picks the stop string *completed first* in a text (earliest end, then earliest
    start): generation is sequential, so that is the one that would have stopped it, and the
    answer does not depend on how the text was chunked. ``held_suffix_start`` says how much of
    a text's end could still grow into a stop string and must not be emitted yet.
    """

    __slots__ = ("_stops", "_any", "_max_len", "_prefixes", "_prefix_chars")

    def __init__(self, stops: Iterable[str]) -> None:
        self._stops = tuple(sorted({s for s in stops if s}, key=len, reverse=True))
        # One C-level scan for "any stop string at all" before the exact selection in Python.
        self._any = re.compile("|".join(map(re.escape, self._stops))) if self._stops else None
        self._max_len = len(self._stops[0]) if self._stops else 0
        self._prefixes: tuple[str, ...] | None = None
        if sum(len(s) * (len(s) - 1) // 2 for s in self._stops) <= _MAX_PREFIX_CHARS:
            prefixes = {s[:k] for s in self._stops for k in range(1, len(s))}
            # Longest first: the first prefix a text ends with is the longest such suffix.
            self._prefixes = tuple(sorted(prefixes, key=len, reverse=True))
        self._prefix_chars = frozenset(char for s in self._stops for char in s[:-1])

    def __bool__(self) -> bool:
        return bool(self._stops)

    def find(self, text: str, min_end: int = 0) -> tuple[int, int] | None:
        """``(start, end)`` of the first-completed stop string whose end is > ``min_end``."""
        if self._any is None:
            return None
        if self._any.search(text, max(0, min_end - self._max_len + 1)) is None:
            return None  # the common case
        best: tuple[int, int] | None = None
        for stop in self._stops:
            start = text.find(stop, max(0, min_end - len(stop) + 1))
            if start != -1:
                candidate = (start + len(stop), start)
                if best is None or candidate < best:
                    best = candidate
        return None if best is None else (best[1], best[0])

    def held_suffix_start(self, text: str) -> int:
        """Start of the longest suffix of ``text`` that is a proper prefix of a stop string
        (``len(text)`` when there is none)."""
        size = len(text)
        prefixes = self._prefixes
        if prefixes is not None:
            if not prefixes or not text.endswith(prefixes):
                return size  # the common case: nothing to hold
            for prefix in prefixes:
                if text.endswith(prefix):
                    return size - len(prefix)
            return size
        if not size or text[-1] not in self._prefix_chars:
            return size
        hold = size
        for stop in self._stops:
            first = stop[0]
            pos = text.find(first, max(0, size - len(stop) + 1))
            while pos != -1 and pos < hold:
                if stop.startswith(text[pos:]):
                    hold = pos
                    break
                pos = text.find(first, pos + 1)
        return hold


NO_STOPS = StopStrings(())
"""The empty set of stop strings (shared: a ``StopStrings`` is immutable)."""
