"""Turning an engine into a served worker: the same start-up for every engine.

An engine package's ``__main__`` parses its own flags plus :func:`add_worker_arguments`, then
calls :func:`serve_engine` with a factory that builds one engine given the worker's
:class:`KVPublisher` (the sinks for KV events and load) and a :class:`WorkerSpec` (model, role,
endpoint, engines per process). Everything else is here: the runtime, KV event publishing and
the ``kv_recovery`` endpoint, the status server, registration, signals and the ordered
shutdown of ``Worker``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from dynamo.backend.engine import LLMEngine
from dynamo.backend.health_check import HealthCheckConfig
from dynamo.backend.kv_publisher import KVPublisher
from dynamo.backend.run import run_async
from dynamo.backend.status_server import StatusConfig
from dynamo.backend.worker import Worker, WorkerConfig
from dynamo.observability.logging import add_log_flag, configure_logging
from dynamo.observability.tracing import setup_tracing
from dynamo.protocol.model_card import WorkerRole
from dynamo.runtime.config import RuntimeConfig, add_flag
from dynamo.runtime.heap import settle_after_start
from dynamo.runtime.huge_pages import back_heap_with_huge_pages
from dynamo.runtime.naming import EndpointId
from dynamo.runtime.runtime import DistributedRuntime, InProcessHub

EngineFactory = Callable[[KVPublisher], LLMEngine]
"""Builds one engine; it publishes KV events and load through the publisher's sinks
(``publish_kv``, ``publish_load``)."""


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What the engine side decides about the worker: the model it serves, its role, where it
    registers (``endpoint``: ``dyn://ns.component.endpoint``; None: the role's default) and
    how many engines share the process (each its own instance)."""

    model_path: str
    served_model_name: str | None = None
    role: WorkerRole = WorkerRole.AGGREGATED
    endpoint: str | None = None
    num_engines: int = 1


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """The worker flags every engine shares (see :func:`add_worker_arguments`)."""

    graceful_shutdown_timeout: float = 5.0
    system_host: str = "0.0.0.0"
    system_port: int | None = None
    log_level: str = "info"
    migration_limit: int = 0
    strict_validation: bool = False
    status: StatusConfig = field(default_factory=StatusConfig)
    health_check: HealthCheckConfig = field(default_factory=HealthCheckConfig)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeOptions:
        return cls(
            graceful_shutdown_timeout=args.graceful_shutdown_timeout,
            system_host=args.system_host,
            system_port=args.system_port,
            log_level=args.log_level,
            migration_limit=args.migration_limit,
            strict_validation=args.strict_stream_validation,
            status=StatusConfig.from_args(args),
            health_check=HealthCheckConfig.from_args(args),
        )


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """The runtime flags and the worker flags (each with its ``DYN_*`` twin)."""
    RuntimeConfig.add_arguments(parser)
    d = ServeOptions()
    add_flag(
        parser,
        "--graceful-shutdown-timeout",
        default=d.graceful_shutdown_timeout,
        type=float,
        help="seconds in-flight requests get to finish on shutdown",
    )
    add_flag(
        parser,
        "--system-port",
        default=d.system_port,
        type=int,
        env="DYN_SYSTEM_PORT",
        help="serve /health, /live and /metrics on this port (0: any free port)",
    )
    add_flag(
        parser,
        "--system-host",
        default=d.system_host,
        env="DYN_SYSTEM_HOST",
        help="address of the status server",
    )
    add_log_flag(parser)
    add_flag(
        parser,
        "--migration-limit",
        default=d.migration_limit,
        type=int,
        help="advertised in the model card: times a frontend may move a request of this worker "
        "to another when this one fails (a frontend's own --migration-limit overrides it)",
    )
    add_flag(
        parser,
        "--strict-stream-validation",
        default=d.strict_validation,
        type=bool,
        help="raise on an engine's stream-contract violation instead of repairing it (debug)",
    )
    StatusConfig.add_arguments(parser)
    HealthCheckConfig.add_arguments(parser)


def build_served_worker(
    engine_factory: EngineFactory,
    spec: WorkerSpec,
    runtime_config: RuntimeConfig,
    options: ServeOptions | None = None,
    *,
    hub: InProcessHub | None = None,
    install_signal_handlers: bool = True,
) -> Worker:
    """A Worker serving ``spec.num_engines`` engines from ``engine_factory`` under one runtime
    (``hub``: in-process planes shared with other components of this process)."""
    options = options or ServeOptions()
    component: str | None = None
    endpoint_name = "generate"
    if spec.endpoint is not None:
        endpoint = EndpointId.parse(spec.endpoint)
        if endpoint.namespace != runtime_config.namespace:
            raise ValueError("--endpoint must be in the runtime's --namespace")
        component, endpoint_name = endpoint.component, endpoint.endpoint
    worker_config = WorkerConfig(
        runtime=runtime_config,
        model_path=spec.model_path,
        served_model_name=spec.served_model_name,
        component=component,
        endpoint=endpoint_name,
        role=spec.role,
        graceful_shutdown_timeout=options.graceful_shutdown_timeout,
        install_signal_handlers=install_signal_handlers,
        system_host=options.system_host,
        system_port=options.system_port,
        migration_limit=options.migration_limit,
        strict_validation=options.strict_validation,
        status=options.status,
        health_check=options.health_check,
    )
    runtime = DistributedRuntime(runtime_config, hub)
    publisher = KVPublisher(runtime)
    engines = [engine_factory(publisher) for _ in range(spec.num_engines)]
    worker = Worker(engines, worker_config, runtime=runtime, owns_runtime=True)
    generate = worker_config.endpoint_id()

    async def serve_recovery(w: Worker) -> None:
        await publisher.serve_recovery(generate, w.worker_ids)

    worker.on_registered(serve_recovery)
    return worker


def serve_engine(
    engine_factory: EngineFactory,
    spec: WorkerSpec,
    args: argparse.Namespace,
    *,
    name: str,
    on_worker: Callable[[Worker], None] | None = None,
) -> int:
    """Serve until SIGTERM/SIGINT; ``args`` holds :func:`add_worker_arguments`' flags.
    ``on_worker`` sees the built worker before it runs (e.g. to register the engine's own
    metrics). Returns the process exit status (2: a configuration error, reported on stderr as
    ``name: ...``)."""
    options = ServeOptions.from_args(args)
    try:
        configure_logging(options.log_level)
        setup_tracing(name.replace(" ", "-"))
        worker = build_served_worker(engine_factory, spec, RuntimeConfig.from_args(args), options)
        if on_worker is not None:
            on_worker(worker)
    except (ValueError, OSError) as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    settle_after_start()  # the engine is built: what it allocated stays
    back_heap_with_huge_pages()  # cheap to tear down: a SIGKILL is seen sooner
    run_async(worker.run())
    return 0
