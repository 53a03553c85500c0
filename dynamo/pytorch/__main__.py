"""``python -m dynamo.pytorch --model-path DIR``: serve a Hugging Face causal LM with the
PyTorch engine (wired into a Worker as the mocker's ``__main__`` does)."""

from __future__ import annotations

import argparse
import sys

from dynamo.backend.kv_publisher import KVPublisher
from dynamo.backend.run import run_async
from dynamo.backend.worker import Worker, WorkerConfig
from dynamo.observability.logging import add_log_flag, configure_logging
from dynamo.observability.tracing import setup_tracing
from dynamo.pytorch.config import TorchEngineConfig
from dynamo.pytorch.engine import ConstraintFactory, TorchEngine
from dynamo.pytorch.metrics import EngineCollector
from dynamo.runtime.config import RuntimeConfig, add_flag
from dynamo.runtime.naming import EndpointId
from dynamo.runtime.runtime import DistributedRuntime, InProcessHub


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser("dynamo pytorch", description="a PyTorch LLM engine")
    TorchEngineConfig.add_arguments(parser)
    RuntimeConfig.add_arguments(parser)
    add_flag(
        parser,
        "--graceful-shutdown-timeout",
        default=5.0,
        type=float,
        help="seconds in-flight requests get to finish on shutdown",
    )
    add_flag(
        parser,
        "--system-port",
        default=None,
        type=int,
        env="DYN_SYSTEM_PORT",
        help="serve /health, /live and /metrics on this port (0: any free port)",
    )
    add_flag(
        parser, "--system-host", default="0.0.0.0", env="DYN_SYSTEM_HOST", help="status server"
    )
    add_log_flag(parser)
    return parser


def build_worker(
    config: TorchEngineConfig,
    runtime_config: RuntimeConfig,
    *,
    graceful_shutdown_timeout: float = 5.0,
    hub: InProcessHub | None = None,
    install_signal_handlers: bool = True,
    system_host: str = "0.0.0.0",
    system_port: int | None = None,
    constraint_factory: ConstraintFactory | None = None,
) -> Worker:
    """A Worker serving one PyTorch engine under its own runtime. ``constraint_factory``
    (guided decoding) makes the engine honour ``sampling.guided_decoding``."""
    runtime = DistributedRuntime(runtime_config, hub)
    publisher = KVPublisher(runtime)
    engine = TorchEngine(
        config,
        kv_event_sink=publisher.publish_kv,
        load_sink=publisher.publish_load,
        constraint_factory=constraint_factory,
    )
    endpoint = EndpointId.parse(config.endpoint_for(runtime_config.namespace))
    if endpoint.namespace != runtime_config.namespace:
        raise ValueError("--endpoint must be in the runtime's --namespace")
    worker_config = WorkerConfig(
        runtime=runtime_config,
        model_path=config.model_path,
        served_model_name=config.served_model_name,
        component=endpoint.component,
        endpoint=endpoint.endpoint,
        graceful_shutdown_timeout=graceful_shutdown_timeout,
        install_signal_handlers=install_signal_handlers,
        system_host=system_host,
        system_port=system_port,
    )
    worker = Worker([engine], worker_config, runtime=runtime, owns_runtime=True)
    worker.metrics_registry.register(EngineCollector(engine, worker.worker_ids[0]))

    async def serve_recovery(w: Worker) -> None:
        await publisher.serve_recovery(endpoint, w.worker_ids)

    worker.on_registered(serve_recovery)
    return worker


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        configure_logging(args.log_level)
        setup_tracing("dynamo-pytorch")
        config = TorchEngineConfig.from_args(args)
        if not config.model_path:
            raise ValueError("--model-path is required")
        worker = build_worker(
            config,
            RuntimeConfig.from_args(args),
            graceful_shutdown_timeout=args.graceful_shutdown_timeout,
            system_host=args.system_host,
            system_port=args.system_port,
        )
    except (ValueError, OSError) as exc:
        print(f"dynamo pytorch: {exc}", file=sys.stderr)
        return 2
    run_async(worker.run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
