"""Log lines made now and written a few turns of the event loop later.

For the lines of a hot path whose next step is a network write that must not wait behind a
synchronous write to stderr (~0.1 ms a JSONL line, more on a busy host). A request-plane
connection flushes what one turn queued early in the next (``request_plane/tcp_connection.py``),
so a failover's lines (``runtime/client.py``, ``frontend/migration.py``) are written once the
continuations of the failed streams have left (two turns), and the mocker's first-token lines
once those tokens have (three: its consumers encode them one turn after it wakes them).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import sys


def log_later(logger: logging.Logger, level: int, msg: str, *args: object, turns: int = 2) -> None:
    """Log ``msg % args`` as made now but write it ``turns`` turns of the event loop later.

    The record is made now: its time, file and line are now's, and it is handled in a copy of
    the current context, so the current span's trace ids still label it. Without a running loop
    it is written at once. A line still pending when the loop stops is lost: nothing that
    reports a process's end may go through here."""
    if not logger.isEnabledFor(level):
        return
    caller = sys._getframe(1)  # what findCaller would find, without its frame walk
    record = logger.makeRecord(
        logger.name, level, caller.f_code.co_filename, caller.f_lineno, msg, args, None
    )
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        logger.handle(record)
        return

    def later(left: int) -> None:
        if left > 0:
            loop.call_soon(later, left - 1)  # in the same copied context
        else:
            logger.handle(record)

    loop.call_soon(later, turns - 1, context=contextvars.copy_context())
