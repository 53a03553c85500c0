"""``python -m dynamo.frontend``: the OpenAI-compatible HTTP frontend."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from dynamo.backend.run import run_async
from dynamo.frontend.app import FrontendService
from dynamo.frontend.config import FrontendConfig
from dynamo.observability.logging import add_log_flag, configure_logging
from dynamo.observability.tracing import setup_tracing
from dynamo.preprocess.tokenizer import serial_tokenization
from dynamo.runtime.heap import settle_after_start


async def serve(config: FrontendConfig) -> None:
    """Run until SIGTERM/SIGINT, then stop taking requests and shut down in order."""
    service = FrontendService(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await service.start()
        settle_after_start()
        print(f"dynamo frontend: listening on http://{config.http_host}:{service.port}", flush=True)
        await stop.wait()
    finally:
        await service.stop()


def build_parser() -> argparse.ArgumentParser:
    """The frontend's flags (``dynamo serve`` offers them too)."""
    parser = FrontendConfig.build_parser()
    add_log_flag(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    serial_tokenization()
    try:
        configure_logging(args.log_level)
        setup_tracing("dynamo-frontend")
        config = FrontendConfig.from_args(args)
    except ValueError as exc:
        print(f"dynamo frontend: {exc}", file=sys.stderr)
        return 2
    run_async(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
