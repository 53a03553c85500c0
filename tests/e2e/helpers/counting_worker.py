"""A worker process serving tests.fakes.CountingEngine (for e2e tests of the backend contract).

Env: DYN_FILE_KV (discovery dir), TOKEN_DELAY (seconds per token), GRACE (grace period).
Lifecycle markers are printed to stdout, one per line, flushed: READY <worker_id hex>, ABORT <id>,
DRAIN, CLEANUP.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from dynamo.backend.run import run_async  # noqa: E402
from dynamo.backend.worker import Worker, WorkerConfig  # noqa: E402
from dynamo.observability.logging import configure_logging  # noqa: E402
from dynamo.runtime.config import RuntimeConfig  # noqa: E402
from dynamo.runtime.context import Context  # noqa: E402
from tests.fakes import CountingEngine  # noqa: E402


class ReportingEngine(CountingEngine):
    async def abort(self, ctx: Context) -> None:
        await super().abort(ctx)
        print(f"ABORT {ctx.id}", flush=True)

    async def drain(self) -> None:
        print("DRAIN", flush=True)

    async def cleanup(self) -> None:
        print("CLEANUP", flush=True)


async def main() -> None:
    configure_logging("info")
    config = WorkerConfig(
        runtime=RuntimeConfig(
            discovery_backend="file",
            discovery_dir=os.environ["DYN_FILE_KV"],
            lease_ttl=float(os.environ.get("LEASE_TTL", "2")),
        ),
        graceful_shutdown_timeout=float(os.environ.get("GRACE", "5")),
        strict_validation=True,
    )
    worker = Worker([ReportingEngine(delay=float(os.environ.get("TOKEN_DELAY", "0.001")))], config)

    async def announce() -> None:
        await worker.ready.wait()
        print(f"READY {worker.worker_ids[0]:x}", flush=True)

    import asyncio

    task = asyncio.create_task(announce())
    await worker.run()
    task.cancel()


if __name__ == "__main__":
    run_async(main())
