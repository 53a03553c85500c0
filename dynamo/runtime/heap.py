"""The garbage collector's settings for a long-running service process (frontend, worker) or a
CPU-bound batch command (replay, plan).

A request allocates thousands of container objects (decoded JSON, msgspec structs, token lists,
futures, async generator frames), so CPython's default young-generation threshold of 700
allocations runs a collection every fraction of a request: on the 2-core VM the frontend spent
~0.23 ms of its ~2.5 ms of CPU per request in the collector at c=64 (``gc.callbacks``, thread
time), nearly all of it in ~480 young collections per 2,200 requests. A threshold of 7,000 runs
ten times fewer of them at the same total work per object, and freezing what start-up allocated
(modules, tokenizer tables, templates: ~25k objects) keeps the rare full collections from
traversing it again; together ~0.15 ms per request less (measured the same way: 503 -> 182 ms
of collector time per 2,200 requests). Cyclic garbage still goes: only its latency grows, by a
few kilobytes.

The CPU-bound batch commands (``dynamo replay``, ``dynamo plan``: ``dynamo.cli``) settle the
same way right after their imports: a replay's in-flight requests hold long token lists, which
every young collection traversed again (8,000 requests of the benchmark's shape: 82
collections, 190-220 ms of collector CPU, ~4 % of the run; settled: 8 collections, 48-62 ms).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final

YOUNG_THRESHOLD: Final = 7000
"""Allocations (net of frees) between young-generation collections (CPython's default: 700)."""


def settle_after_start() -> None:
    """Freeze every object alive now and raise the young-generation threshold. Process-wide:
    call it from a service's entry point once start-up is done (never from library code, which
    may share a process with tests or other services)."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)


@contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic collection inside the block; the caller's setting (enabled or not) is back
    afterwards, also when the block raises. Process-wide (every thread's allocations go
    uncollected meanwhile), so only for CPU-bound work that leaves no cyclic garbage, which a
    test proves for it: reference counting frees all it drops, and what it keeps (its result)
    is collected as usual afterwards. The replay's simulation runs inside one
    (``replay.simulator``): its in-flight requests hold long token lists, which every young
    collection traversed again, and it makes no cyclic garbage a request."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
