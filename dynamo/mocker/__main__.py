"""``python -m dynamo.mocker``: serve N mocker engines (``--num-workers``) in one worker process.

The worker wiring is :mod:`dynamo.backend.serve_engine` (the same for every engine); this module
only says how to build a mocker engine from its flags.
"""

from __future__ import annotations

import argparse
import sys

from dynamo.backend.kv_publisher import KVPublisher
from dynamo.backend.serve_engine import (
    EngineFactory,
    ServeOptions,
    WorkerSpec,
    add_worker_arguments,
    build_served_worker,
    serve_engine,
)
from dynamo.backend.worker import Worker
from dynamo.mocker.config import MockerConfig
from dynamo.mocker.engine import MockerEngine
from dynamo.protocol.model_card import WorkerRole
from dynamo.runtime.config import RuntimeConfig
from dynamo.runtime.runtime import InProcessHub


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser("dynamo mocker", description="a simulated vLLM-like engine")
    MockerConfig.add_arguments(parser)
    add_worker_arguments(parser)
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


def mocker_engines(config: MockerConfig) -> tuple[EngineFactory, WorkerSpec]:
    """How to build a mocker engine, and the worker it makes."""

    def factory(publisher: KVPublisher) -> MockerEngine:
        return MockerEngine(
            config, kv_event_sink=publisher.publish_kv, load_sink=publisher.publish_load
        )

    spec = WorkerSpec(
        model_path=config.model_path or "",
        served_model_name=config.served_model_name,
        role=WorkerRole(config.disaggregation_mode),
        endpoint=config.endpoint or None,
        num_engines=config.num_workers,
    )
    return factory, spec


def build_worker(
    config: MockerConfig,
    runtime_config: RuntimeConfig,
    *,
    hub: InProcessHub | None = None,
    install_signal_handlers: bool = True,
    options: ServeOptions | None = None,
) -> Worker:
    """A Worker serving ``config.num_workers`` mocker engines (in-process serving, tests)."""
    factory, spec = mocker_engines(config)
    return build_served_worker(
        factory,
        spec,
        runtime_config,
        options,
        hub=hub,
        install_signal_handlers=install_signal_handlers,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        factory, spec = mocker_engines(mocker_config(args))
    except (ValueError, OSError) as exc:
        print(f"dynamo mocker: {exc}", file=sys.stderr)
        return 2
    return serve_engine(factory, spec, args, name="dynamo mocker")


if __name__ == "__main__":
    sys.exit(main())
