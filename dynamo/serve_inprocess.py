"""``dynamo serve --in-process``: frontend and workers (mocker or pytorch) in one process.

They share an :class:`InProcessHub` (memory discovery, in-process request and event planes), so
nothing is bound but the HTTP port.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
from typing import TYPE_CHECKING

from dynamo.backend.run import run_async
from dynamo.backend.serve_engine import ServeOptions
from dynamo.backend.worker import Worker
from dynamo.frontend.app import FrontendService
from dynamo.frontend.config import FrontendConfig
from dynamo.mocker.config import MockerConfig
from dynamo.observability.logging import configure_logging
from dynamo.observability.tracing import setup_tracing
from dynamo.preprocess.tokenizer import serial_tokenization
from dynamo.runtime.config import RuntimeConfig
from dynamo.runtime.runtime import InProcessHub
from dynamo.serve_args import ServePlan

if TYPE_CHECKING:
    from dynamo.pytorch.config import TorchEngineConfig


def serve_in_process(serve_plan: ServePlan) -> int:
    """Run the validated plan in this process (the planes' flags do not apply here)."""
    serial_tokenization()
    configure_logging(getattr(serve_plan.args, "both:log_level", None))
    setup_tracing("dynamo-serve")
    runtime_config = RuntimeConfig(
        namespace=serve_plan.args.namespace,
        discovery_backend="memory",
        request_plane="local",
        event_plane="local",
    )
    frontend_config = dataclasses.replace(serve_plan.frontend, runtime=runtime_config)
    configs = [serve_plan.worker_config(role) for role in serve_plan.roles]
    # Each worker runs its own status server, as in separate processes: a fixed --system-port
    # with several workers is refused by the plan, port 0 gives each worker a free port.
    run_async(_serve(frontend_config, configs, runtime_config, serve_plan.worker_options))
    return 0


def _build_worker(
    config: MockerConfig | TorchEngineConfig,
    runtime_config: RuntimeConfig,
    hub: InProcessHub,
    options: ServeOptions,
) -> Worker:
    if isinstance(config, MockerConfig):
        from dynamo.mocker.__main__ import build_worker as mocker_worker

        return mocker_worker(
            config, runtime_config, hub=hub, install_signal_handlers=False, options=options
        )
    from dynamo.pytorch.__main__ import build_worker as torch_worker

    return torch_worker(
        config, runtime_config, hub=hub, install_signal_handlers=False, options=options
    )


async def _serve(
    frontend_config: FrontendConfig,
    configs: list[MockerConfig | TorchEngineConfig],
    runtime_config: RuntimeConfig,
    options: ServeOptions,
) -> None:
    hub = InProcessHub()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    worker_objs = [_build_worker(config, runtime_config, hub, options) for config in configs]
    tasks = [asyncio.create_task(w.run(), name=f"worker-{i}") for i, w in enumerate(worker_objs)]
    frontend = FrontendService(frontend_config, hub=hub)
    try:
        await frontend.start()
        print(
            f"dynamo serve (in-process): http://{frontend_config.http_host}:{frontend.port}",
            flush=True,
        )
        await stop.wait()
    finally:
        await frontend.stop()
        for w in worker_objs:
            w.request_shutdown()
        await asyncio.gather(*tasks, return_exceptions=True)
