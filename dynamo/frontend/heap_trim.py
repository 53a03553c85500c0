"""Gives the memory a large request used back to the operating system.

A large prompt passes through several allocators' hands: the HTTP layer buffers the body,
msgspec decodes it (in a helper process past a size), HF ``tokenizers`` encodes it (Rust, on an
offload thread). Each thread allocates from its own glibc arena, and glibc returns an arena's
freed pages only when they sit at its top, so after one 4 MB prompt was tokenized the frontend
stayed ~300 MB larger, and a few huge prompts left it at 700+ MB (issue 12 measured 2 GB).
``malloc_trim(0)`` walks every arena and releases its free pages; it is cheap next to the
request that made them (a few ms), and it runs on an offload thread, never on the event loop.
Elsewhere than glibc: a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

TRIM_AFTER_BYTES = 1024 * 1024
"""A request whose body was at least this large is followed by a trim."""


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim: Callable[[int], int] = libc.malloc_trim
    except (OSError, AttributeError):
        return None  # not glibc (musl, macOS)
    return trim


def trim_heap() -> bool:
    """Release every arena's free pages (blocking: call it off the event loop). True if the
    C library did (glibc), False where it cannot."""
    trim = _malloc_trim()
    if trim is None:
        return False
    return bool(trim(0))
