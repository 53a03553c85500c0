"""``run(engine, config)``: the single entry point every engine's ``__main__`` calls."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from dynamo.backend.engine import LLMEngine
from dynamo.backend.worker import Worker, WorkerConfig

T = TypeVar("T")


def run(engine: LLMEngine | Sequence[LLMEngine], config: WorkerConfig) -> None:
    """Serve ``engine`` (or several engines sharing one runtime) until SIGTERM/SIGINT."""
    engines = [engine] if isinstance(engine, LLMEngine) else list(engine)
    run_async(Worker(engines, config).run())


def run_async(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` on uvloop where available (a core dependency; stay runnable without it)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.run(main)
    return uvloop.run(main)  # type: ignore[no-any-return]
