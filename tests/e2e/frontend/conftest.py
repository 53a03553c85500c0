"""Module-scoped fixtures for the frontend's end-to-end tests (one server per test file)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.frontend.frontend_stack import (
    Child,
    Stack,
    child_env,
    free_port,
    wait_http,
    wait_instances,
)


@pytest.fixture(scope="session")
def serve_stack() -> Iterator[Stack]:
    """`dynamo serve` (2 mockers at speedup 0) with a 1 MiB body limit, on an ephemeral port."""
    stack = Stack()
    stack.port = free_port()
    env = child_env(None, DYN_HTTP_BODY_LIMIT_MB="1")
    child = Child(
        ["-m", "dynamo.serve", "--http-host", "127.0.0.1", "--http-port", str(stack.port)]
        + ["--speedup-ratio", "0"],
        env,
    )
    stack.children.append(child)
    try:
        wait_http(stack.port, "/health")
        wait_instances(stack.port, 2)
    except AssertionError:
        child.stop()
        raise AssertionError(child.tail()) from None
    yield stack
    stack.close()
