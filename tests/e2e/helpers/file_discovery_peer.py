"""Subprocess peer for tests/e2e/test_file_discovery_processes.py.

Registers ``peers/<name>`` under a lease in a FileDiscovery directory, prints ``READY`` and then
one line per watch event (``put <key>`` / ``delete <key>``), and closes cleanly on SIGTERM.
Usage: python file_discovery_peer.py DIRECTORY NAME TTL
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

from dynamo.runtime.discovery.base import Watch
from dynamo.runtime.discovery.file import FileDiscovery


def say(line: str) -> None:
    print(line, flush=True)


async def follow(watch: Watch) -> None:
    async for event in watch:
        say(f"{event.kind} {event.key}")


async def main(directory: str, name: str, ttl: float) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    discovery = FileDiscovery(directory, poll_interval=0.05)
    try:
        lease = await discovery.grant_lease(ttl)
        await discovery.put(f"peers/{name}", str(os.getpid()).encode(), lease)
        watch = await discovery.watch_prefix("peers/")
        for kv in watch.snapshot:
            say(f"put {kv.key}")
        say("READY")
        follower = asyncio.create_task(follow(watch), name="peer-watch")
        await stop.wait()
        follower.cancel()
        await asyncio.wait({follower})
        await watch.close()
    finally:
        await discovery.close()
    say("CLOSED")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3])))
