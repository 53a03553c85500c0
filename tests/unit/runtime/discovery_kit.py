"""Reading a discovery watch in tests: the next event within a deadline, or that none comes."""

from __future__ import annotations

import asyncio

from dynamo.runtime.discovery.base import Watch, WatchEvent


async def next_event(watch: Watch, timeout: float = 5.0) -> WatchEvent:
    async with asyncio.timeout(timeout):
        return await anext(aiter(watch))


async def no_event(watch: Watch, wait: float = 0.3) -> bool:
    """True when nothing arrives within ``wait`` seconds."""
    try:
        await next_event(watch, timeout=wait)
    except TimeoutError:
        return True
    return False
