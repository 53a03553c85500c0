"""``python -m dynamo.pytorch --model-path DIR``: serve a Hugging Face causal LM with the
PyTorch engine.

The worker wiring is :mod:`dynamo.backend.serve_engine` (the same for every engine); this module
only says how to build a PyTorch engine from its flags, and registers the engine's own metrics
on the worker's status server.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from dynamo.backend.kv_publisher import KVPublisher
from dynamo.backend.kv_transfer import KVTransferAgent
from dynamo.backend.serve_engine import (
    EngineFactory,
    ServeOptions,
    WorkerSpec,
    add_worker_arguments,
    build_served_worker,
    serve_engine,
)
from dynamo.backend.worker import Worker
from dynamo.protocol.model_card import WorkerRole
from dynamo.pytorch.config import TorchEngineConfig
from dynamo.pytorch.engine import ConstraintFactory, TorchEngine
from dynamo.pytorch.metrics import EngineCollector
from dynamo.runtime.config import RuntimeConfig
from dynamo.runtime.runtime import InProcessHub


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser("dynamo pytorch", description="a PyTorch LLM engine")
    TorchEngineConfig.add_arguments(parser)
    add_worker_arguments(parser)
    return parser


def torch_engines(
    config: TorchEngineConfig, *, constraint_factory: ConstraintFactory | None = None
) -> tuple[EngineFactory, WorkerSpec, Callable[[Worker], None]]:
    """How to build the engine, the worker it makes, and the hook that registers the engine's
    metrics once the worker exists (``constraint_factory``: see ``TorchEngine``)."""
    if not config.model_path:
        raise ValueError("--model-path is required")
    engines: list[TorchEngine] = []

    def factory(publisher: KVPublisher) -> TorchEngine:
        transfer: KVTransferAgent | None = None
        if config.role is not WorkerRole.AGGREGATED:  # disaggregation: a KV transfer agent
            transfer = KVTransferAgent(
                publisher.runtime, None, host=config.kv_transfer_host, port=config.kv_transfer_port
            )
        engine = TorchEngine(
            config,
            kv_event_sink=publisher.publish_kv,
            load_sink=publisher.publish_load,
            constraint_factory=constraint_factory,
            transfer=transfer,
        )
        if transfer is not None and config.role is WorkerRole.PREFILL:
            transfer.serve(engine.export_for_peer)  # decode workers only pull
        engines.append(engine)
        return engine

    def register_metrics(worker: Worker) -> None:
        for engine, worker_id in zip(engines, worker.worker_ids, strict=True):
            EngineCollector(worker.metrics_registry, engine, worker_id)

    spec = WorkerSpec(
        model_path=config.model_path,
        served_model_name=config.served_model_name,
        role=config.role,
        endpoint=config.endpoint,
    )
    return factory, spec, register_metrics


def build_worker(
    config: TorchEngineConfig,
    runtime_config: RuntimeConfig,
    *,
    hub: InProcessHub | None = None,
    install_signal_handlers: bool = True,
    options: ServeOptions | None = None,
    constraint_factory: ConstraintFactory | None = None,
) -> Worker:
    """A Worker serving one PyTorch engine (in-process serving, tests)."""
    factory, spec, register_metrics = torch_engines(config, constraint_factory=constraint_factory)
    worker = build_served_worker(
        factory,
        spec,
        runtime_config,
        options,
        hub=hub,
        install_signal_handlers=install_signal_handlers,
    )
    register_metrics(worker)
    return worker


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        factory, spec, register_metrics = torch_engines(TorchEngineConfig.from_args(args))
    except (ValueError, OSError) as exc:
        print(f"dynamo pytorch: {exc}", file=sys.stderr)
        return 2
    return serve_engine(factory, spec, args, name="dynamo pytorch", on_worker=register_metrics)


if __name__ == "__main__":
    sys.exit(main())
