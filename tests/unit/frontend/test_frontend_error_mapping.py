"""The one error -> HTTP mapping: statuses, OpenAI body shape, Retry-After, no tracebacks."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from dynamo.frontend.errors import HTTPError, error_payload, to_http
from dynamo.protocol.openai import ChatCompletionRequest
from dynamo.runtime import errors as E

pytestmark = pytest.mark.unit


def body(reply_body: bytes) -> dict[str, Any]:
    data = json.loads(reply_body)
    assert set(data) == {"error"}
    assert set(data["error"]) == {"message", "type", "param", "code"}
    return dict(data["error"])


@pytest.mark.parametrize(
    ("exc", "status", "label"),
    [
        (E.InvalidArgument("bad"), 400, "validation"),
        (E.ModelNotFound("no such model"), 404, "not_found"),
        (E.NoInstances("Model temporarily unavailable"), 503, "unavailable"),
        (E.Overloaded("busy"), 529, "overload"),
        (E.StreamIncomplete("lost"), 502, "internal"),
        (E.EngineShutdown("engine down"), 502, "unavailable"),
        (E.WorkerShutdown("worker leaving"), 502, "unavailable"),
        (E.ResponseTimeout("silent worker"), 504, "response_timeout"),
        (E.Cancelled("gone"), 499, "cancelled"),
        (HTTPError(405, "no"), 405, "validation"),
        (HTTPError(413, "too big"), 413, "validation"),
        (HTTPError(404, "no route"), 404, "not_found"),
    ],
)
def test_status_and_label(exc: BaseException, status: int, label: str) -> None:
    reply = to_http(exc)
    assert reply.status == status and reply.error_type == label
    err = body(reply.body)
    assert err["code"] in (status, "model_not_found")
    retry = dict(reply.headers).get("retry-after")
    assert (retry is not None) == (status in (503, 529))


def test_no_worker_engine_down_and_timeout_are_told_apart() -> None:
    kinds = {
        body(to_http(exc).body)["type"]
        for exc in (E.NoInstances("x"), E.EngineShutdown("x"), E.ResponseTimeout("x"))
    }
    assert kinds == {"service_unavailable", "engine_unavailable", "timeout"}


def test_overload_status_is_configurable() -> None:
    reply = to_http(E.Overloaded("busy"), overload_status=503)
    assert reply.status == 503 and dict(reply.headers)["retry-after"] == "1"
    assert body(reply.body)["code"] == 503


def test_validation_errors_name_the_field() -> None:
    decoder = msgspec.json.Decoder(ChatCompletionRequest)
    cases = {
        b'{"messages": []}': "model",
        b'{"model": "m"}': "messages",
        b'{"model": "m", "messages": [], "temperature": 3}': "temperature",
        b'{"model": "m", "messages": [{"content": "x"}]}': "messages",
    }
    for raw, param in cases.items():
        with pytest.raises(msgspec.ValidationError) as info:
            decoder.decode(raw)
        reply = to_http(info.value)
        err = body(reply.body)
        assert reply.status == 400 and err["param"] == param, (raw, err)
        assert err["message"].startswith("Validation: ")
    with pytest.raises(msgspec.DecodeError) as bad:
        decoder.decode(b"{")
    assert to_http(bad.value).status == 400


def test_unexpected_exception_is_a_500_without_traceback(caplog: Any) -> None:
    reply = to_http(KeyError("secret internals"))
    err = body(reply.body)
    assert reply.status == 500 and err["message"] == "internal error: KeyError"
    assert "Traceback" not in reply.body.decode() and "secret" not in reply.body.decode()
    assert body(error_payload(E.StreamIncomplete("lost")))["code"] == 502
