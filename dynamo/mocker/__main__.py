"""``python -m dynamo.mocker``: serve N mocker engines (``--num-workers``) in one worker process."""

from __future__ import annotations

import argparse
import sys

from dynamo.backend.disagg import DisaggregationMode
from dynamo.backend.kv_publisher import KVPublisher
from dynamo.backend.run import configure_logging, run_async
from dynamo.backend.worker import Worker, WorkerConfig
from dynamo.mocker.config import MockerConfig
from dynamo.mocker.engine import MockerEngine
from dynamo.runtime.config import RuntimeConfig, add_flag
from dynamo.runtime.naming import EndpointId
from dynamo.runtime.runtime import DistributedRuntime, InProcessHub


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser("dynamo mocker", description="a simulated vLLM-like engine")
    MockerConfig.add_arguments(parser)
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
        parser,
        "--system-host",
        default="0.0.0.0",
        env="DYN_SYSTEM_HOST",
        help="address of the status server",
    )
    add_flag(parser, "--log-level", default="INFO", help="logging level")
    return parser


def mocker_config(args: argparse.Namespace) -> MockerConfig:
    """The config with vocabulary facts read from the model's tokenizer, when there is one."""
    overrides: dict[str, object] = {}
    if args.model_path:
        from dynamo.preprocess import load_model_dir

        model = load_model_dir(args.model_path)
        overrides["vocab_size"] = model.tokenizer.vocab_size
        overrides["special_token_ids"] = frozenset(model.tokenizer.special_token_ids) | frozenset(
            model.eos_token_ids
        )
        if args.context_length is None:
            overrides["context_length"] = model.context_length
    return MockerConfig.from_args(args, **overrides)


def build_worker(
    config: MockerConfig,
    runtime_config: RuntimeConfig,
    *,
    graceful_shutdown_timeout: float = 5.0,
    hub: InProcessHub | None = None,
    install_signal_handlers: bool = True,
    system_host: str = "0.0.0.0",
    system_port: int | None = None,
) -> Worker:
    """A Worker serving ``config.num_workers`` mocker engines under one runtime."""
    runtime = DistributedRuntime(runtime_config, hub)
    publisher = KVPublisher(runtime)
    engines = [
        MockerEngine(config, kv_event_sink=publisher.publish_kv, load_sink=publisher.publish_load)
        for _ in range(config.num_workers)
    ]
    endpoint = EndpointId.parse(config.endpoint_for(runtime_config.namespace))
    worker_config = WorkerConfig(
        runtime=runtime_config,
        model_path=config.model_path or "",
        served_model_name=config.served_model_name,
        component=endpoint.component,
        endpoint=endpoint.endpoint,
        disaggregation_mode=DisaggregationMode(config.disaggregation_mode),
        graceful_shutdown_timeout=graceful_shutdown_timeout,
        install_signal_handlers=install_signal_handlers,
        system_host=system_host,
        system_port=system_port,
    )
    if endpoint.namespace != runtime_config.namespace:
        raise ValueError("--endpoint must be in the runtime's --namespace")
    worker = Worker(engines, worker_config, runtime=runtime, owns_runtime=True)

    async def serve_recovery(w: Worker) -> None:
        await publisher.serve_recovery(endpoint, w.worker_ids)

    worker.on_registered(serve_recovery)
    return worker


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    try:
        config = mocker_config(args)
        runtime_config = RuntimeConfig.from_args(args)
        worker = build_worker(
            config,
            runtime_config,
            graceful_shutdown_timeout=args.graceful_shutdown_timeout,
            system_host=args.system_host,
            system_port=args.system_port,
        )
    except (ValueError, OSError) as exc:
        print(f"dynamo mocker: {exc}", file=sys.stderr)
        return 2
    run_async(worker.run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
