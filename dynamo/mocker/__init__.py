"""The mocker: a CPU-only engine that behaves like vLLM under load (scheduler, prefix-cached KV
pool, KV events, reference timing model) without a model. ``python -m dynamo.mocker`` serves it."""

from dynamo.mocker.config import MockerConfig
from dynamo.mocker.engine import MockerEngine

__all__ = ["MockerConfig", "MockerEngine"]
