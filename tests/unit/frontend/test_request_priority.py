"""A request's router-queue priority: nvext.agent_hints or the x-dynamo-request-* headers."""

from __future__ import annotations

import msgspec
import pytest

from dynamo.frontend.errors import to_http
from dynamo.frontend.priority import request_priority
from dynamo.protocol.openai import AgentHints, ChatCompletionRequest, NvExt
from dynamo.runtime.errors import InvalidArgument


def test_no_priority_is_zero() -> None:
    assert request_priority(None, (None, None)) == (0.0, 0)
    assert request_priority(NvExt(), (None, None)) == (0.0, 0)


def test_headers_give_the_priority_and_the_body_wins_over_them() -> None:
    assert request_priority(None, ("2.5", "3")) == (2.5, 3)
    body = NvExt(agent_hints=AgentHints(priority=7, strict_priority=1))
    assert request_priority(body, ("2.5", "3")) == (7.0, 1)
    partial = NvExt(agent_hints=AgentHints(priority=7))
    assert request_priority(partial, (None, "3")) == (7.0, 3)


@pytest.mark.parametrize(
    "headers",
    [("-1", None), ("nan", None), ("fast", None), ("1e12", None), (None, "1.5"), (None, "-2")],
)
def test_malformed_headers_are_a_400(headers: tuple[str | None, str | None]) -> None:
    with pytest.raises(InvalidArgument) as bad:
        request_priority(None, headers)
    assert to_http(bad.value).status == 400


def test_agent_hints_are_validated_and_unknown_keys_refused() -> None:
    def decode(hints: object) -> ChatCompletionRequest:
        body = {"model": "m", "messages": [], "nvext": {"agent_hints": hints}}
        return msgspec.convert(body, ChatCompletionRequest)

    assert decode({"priority": 3}).nvext.agent_hints.priority == 3  # type: ignore[union-attr]
    for bad in ({"priority": -1}, {"strict_priority": 1.5}, {"deadline": 3}):
        with pytest.raises(msgspec.ValidationError):
            decode(bad)
