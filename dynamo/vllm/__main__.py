"""``python -m dynamo.vllm --model-path DIR [vLLM engine flags]``: serve a model with vLLM.

Every vLLM engine flag (``AsyncEngineArgs``: ``--block-size``, ``--max-num-seqs``,
``--dtype``, ...) is accepted as vLLM spells it; ours are the worker's (runtime, status server,
``--endpoint``), ``--kv-events`` / ``--no-kv-events``, and the disaggregation role
(``--disaggregation-mode agg|prefill|decode``, ``--kv-transfer-host``: where our KV connector's
transfer agent listens; vLLM's own ``--kv-transfer-config`` is then refused, the role sets it).
The worker wiring is :mod:`dynamo.backend.serve_engine`, as for every engine.
"""

from __future__ import annotations

import argparse
import sys

from dynamo.backend.kv_publisher import KVPublisher
from dynamo.backend.serve_engine import (
    EngineFactory,
    WorkerSpec,
    add_worker_arguments,
    serve_engine,
)
from dynamo.protocol.model_card import WorkerRole
from dynamo.runtime.config import add_flag


def build_parser() -> argparse.ArgumentParser:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    # vLLM's flags first, then ours, with "resolve": where both define a flag (``--log-level``:
    # ours is every process's DYN_LOG-style filter), ours replaces vLLM's. vLLM's own level is
    # its ``--logging-config`` / ``VLLM_LOGGING_LEVEL``.
    parser: argparse.ArgumentParser = FlexibleArgumentParser(
        "dynamo vllm",
        description="vLLM's engine behind a dynamo worker",
        allow_abbrev=False,
        conflict_handler="resolve",
    )
    AsyncEngineArgs.add_cli_args(parser)
    ours = parser.add_argument_group("dynamo vllm")
    add_flag(ours, "--model-path", default=None, help="Hugging Face model directory (vLLM --model)")
    add_flag(ours, "--model-name", default=None, help="served model name")
    add_flag(ours, "--endpoint", default=None, help="dyn://namespace.component.endpoint")
    add_flag(
        ours,
        "--kv-events",
        default=True,
        type=bool,
        env="DYN_VLLM_KV_EVENTS",
        help="bridge vLLM's KV events to the routers (sets vLLM's --kv-events-config)",
    )
    add_flag(
        ours,
        "--disaggregation-mode",
        default=WorkerRole.AGGREGATED.value,
        choices=[role.value for role in WorkerRole],
        help="agg, prefill (run prompts, hand their KV off) or decode (resume from a handoff)",
    )
    add_flag(
        ours,
        "--kv-transfer-host",
        default="127.0.0.1",
        help="address of this worker's KV transfer agent (disaggregation)",
    )
    add_worker_arguments(parser)
    return parser


def vllm_engines(args: argparse.Namespace) -> tuple[EngineFactory, WorkerSpec]:
    from vllm.engine.arg_utils import AsyncEngineArgs

    from dynamo.vllm.engine import VllmEngine

    model = args.model_path or args.model
    if not model:
        raise ValueError("--model-path is required")
    args.model = model
    role = WorkerRole(args.disaggregation_mode)
    if role is not WorkerRole.AGGREGATED and args.kv_transfer_config is not None:
        raise ValueError("--kv-transfer-config cannot be combined with --disaggregation-mode")
    engine_args = AsyncEngineArgs.from_cli_args(args)
    engine_args.log_level = None  # ``args.log_level`` is our worker's filter, not vLLM's level

    def factory(publisher: KVPublisher) -> VllmEngine:
        return VllmEngine(
            engine_args,
            served_model_name=args.model_name,
            kv_event_sink=publisher.publish_kv if args.kv_events else None,
            role=role,
            kv_transfer_host=args.kv_transfer_host,
        )

    spec = WorkerSpec(
        model_path=model, served_model_name=args.model_name, role=role, endpoint=args.endpoint
    )
    return factory, spec


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        factory, spec = vllm_engines(args)
    except (ValueError, OSError) as exc:
        print(f"dynamo vllm: {exc}", file=sys.stderr)
        return 2
    return serve_engine(factory, spec, args, name="dynamo vllm")


if __name__ == "__main__":
    sys.exit(main())
