"""``python -m dynamo.slot_tracker``: run the standalone slot tracker until SIGINT/SIGTERM.

Prints one line ``slot tracker listening on http://HOST:PORT`` to stdout once /health answers
(and ``replica sync bound at ENDPOINT`` before it when replica sync is on).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

import uvloop
import zmq

from dynamo.observability.logging import configure_logging
from dynamo.runtime.heap import settle_after_start
from dynamo.slot_tracker.config import SlotTrackerConfig, add_arguments, from_args
from dynamo.slot_tracker.service import SlotTrackerService


async def serve(config: SlotTrackerConfig) -> None:
    service = SlotTrackerService(config)
    await service.start()
    # /add keeps a tuple of hashes per active request: fewer young collections, and full ones
    # that skip everything start-up allocated (runtime/heap.py).
    settle_after_start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        if service.replica is not None:
            print(f"replica sync bound at {service.replica.bound_endpoint}", flush=True)
        print(f"slot tracker listening on http://{config.host}:{service.port}", flush=True)
        await stop.wait()
    finally:
        await service.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dynamo.slot_tracker", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        config = from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        configure_logging()
    except ValueError as exc:
        parser.error(str(exc))
    try:
        uvloop.run(serve(config))
    except (OSError, zmq.ZMQError) as exc:  # port in use, endpoint not bindable, ...
        print(f"slot tracker: cannot start: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
