"""``python -m dynamo.vllm``'s flags: vLLM's engine flags and the worker's side by side (where
both define one, ``--log-level``, the worker's wins and vLLM does not see it)."""

from __future__ import annotations

from dynamo.vllm.__main__ import build_parser, vllm_engines


def test_worker_and_vllm_flags_parse_together() -> None:
    args = build_parser().parse_args(
        ["--model-path", "/m", "--model-name", "tiny", "--log-level", "dynamo.router=debug,info"]
        + ["--block-size", "32", "--enforce-eager", "--no-kv-events", "--system-port", "0"]
    )
    assert args.log_level == "dynamo.router=debug,info"
    assert args.kv_events is False
    factory, spec = vllm_engines(args)
    assert (spec.model_path, spec.served_model_name) == ("/m", "tiny")
    engine = factory(None)  # type: ignore[arg-type]  # no KV events: the publisher is unused
    assert engine.kv_event_sink is None
    ea = engine.engine_args
    assert (ea.model, ea.block_size, ea.enforce_eager, ea.log_level) == ("/m", 32, True, None)
