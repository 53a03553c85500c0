"""Every client-visible error of the frontend: status, headers and the OpenAI error body
``{"error": {"message", "type", "param", "code"}}``; never a 500 with a traceback."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.e2e.frontend.frontend_stack import Stack, request

pytestmark = pytest.mark.e2e

MODEL = "demo"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]


def error_of(status: int, raw: bytes, expected: int) -> dict[str, Any]:
    assert status == expected, (status, raw[:500])
    assert b"Traceback" not in raw
    body = json.loads(raw)
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert err["param"] is None or isinstance(err["param"], str)
    assert err["code"] is None or isinstance(err["code"], (int, str))
    return dict(err)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, {"messages": MSGS}, "model"),  # missing field
        (CHAT, {"model": MODEL}, "messages"),
        (CHAT, {"model": MODEL, "messages": "hi"}, "messages"),  # wrong type
        (CHAT, {"model": 7, "messages": MSGS}, "model"),
        (CHAT, {"model": MODEL, "messages": MSGS, "max_tokens": "ten"}, "max_tokens"),
        (CHAT, {"model": MODEL, "messages": MSGS, "max_tokens": -1}, "max_tokens"),
        (CHAT, {"model": MODEL, "messages": MSGS, "max_completion_tokens": -5}, None),
        (CHAT, {"model": MODEL, "messages": MSGS, "temperature": 2.5}, "temperature"),
        (CHAT, {"model": MODEL, "messages": MSGS, "temperature": -0.1}, "temperature"),
        (CHAT, {"model": MODEL, "messages": MSGS, "top_p": 1.5}, "top_p"),
        (CHAT, {"model": MODEL, "messages": MSGS, "n": 0}, "n"),
        (CHAT, {"model": MODEL, "messages": MSGS, "stream": "yes"}, "stream"),
        (CHAT, {"model": MODEL, "messages": [{"content": "no role"}]}, None),
        (CHAT, {"model": MODEL, "messages": MSGS, "nvext": {"repetition_penalty": 0}}, None),
        (COMPLETIONS, {"model": MODEL}, "prompt"),
        (COMPLETIONS, {"model": MODEL, "prompt": []}, None),
        (COMPLETIONS, {"model": MODEL, "prompt": [1, "mixed"]}, None),
        (COMPLETIONS, {"model": MODEL, "prompt": "x", "max_tokens": -3}, "max_tokens"),
    ],
)
def test_validation_400(serve_stack: Stack, path: str, body: Any, param: str | None) -> None:
    status, _, raw = request(serve_stack.port, "POST", path, body)
    err = error_of(status, raw, 400)
    assert err["type"] == "invalid_request_error"
    assert err["message"].startswith("Validation")
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.parametrize(
    "raw",
    [b"{not json", b"", b"[1, 2]", b'{"model": "demo", "messages": [', b"\xff\xfe", b"null"],
)
def test_malformed_json_400(serve_stack: Stack, raw: bytes) -> None:
    for path in (CHAT, COMPLETIONS):
        status, _, out = request(serve_stack.port, "POST", path, raw=raw)
        error_of(status, out, 400)


def test_prompt_over_context_length_400(serve_stack: Stack) -> None:
    # the demo model's context is 8192 tokens
    status, _, raw = request(
        serve_stack.port, "POST", COMPLETIONS, {"model": MODEL, "prompt": [100] * 8200}
    )
    err = error_of(status, raw, 400)
    assert "context" in err["message"].lower()
    long_text = "hello " * 9000
    status, _, raw = request(
        serve_stack.port,
        "POST",
        CHAT,
        {"model": MODEL, "messages": [{"role": "user", "content": long_text}], "stream": True},
    )
    error_of(status, raw, 400)
    # a prompt that fits but leaves no room for max_tokens is clamped, not refused
    status, _, raw = request(
        serve_stack.port,
        "POST",
        COMPLETIONS,
        {"model": MODEL, "prompt": [100] * 8185, "max_tokens": 1000},
    )
    assert status == 200, raw
    assert json.loads(raw)["usage"]["completion_tokens"] <= 8192 - 8185


def test_unknown_model_404(serve_stack: Stack) -> None:
    for path, body in (
        (CHAT, {"model": "nope", "messages": MSGS}),
        (CHAT, {"model": "nope", "messages": MSGS, "stream": True}),
        (COMPLETIONS, {"model": "nope", "prompt": "x"}),
    ):
        status, _, raw = request(serve_stack.port, "POST", path, body)
        err = error_of(status, raw, 404)
        assert err["param"] == "model" and "nope" in err["message"]
    status, _, raw = request(serve_stack.port, "GET", "/v1/models/nope")
    error_of(status, raw, 404)


def test_unknown_model_via_openai_client(serve_stack: Stack) -> None:
    with openai.OpenAI(
        base_url=f"http://127.0.0.1:{serve_stack.port}/v1", api_key="x", max_retries=0
    ) as client:
        with pytest.raises(openai.NotFoundError) as info:
            client.chat.completions.create(model="nope", messages=MSGS)  # type: ignore[arg-type]
        assert info.value.status_code == 404
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(
                model=MODEL,
                messages=MSGS,  # type: ignore[arg-type]
                temperature=9,
            )


@pytest.mark.parametrize(
    ("method", "path"), [("GET", "/v2/nothing"), ("POST", "/v1/embedding"), ("DELETE", "/")]
)
def test_unknown_route_404(serve_stack: Stack, method: str, path: str) -> None:
    status, _, raw = request(serve_stack.port, method, path)
    error_of(status, raw, 404)


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("GET", CHAT, "POST"),
        ("PUT", COMPLETIONS, "POST"),
        ("POST", "/v1/models", "GET"),
        ("DELETE", "/v1/models/demo", "GET"),
        ("POST", "/metrics", "GET"),
        ("POST", "/health", "GET"),
    ],
)
def test_wrong_method_405(serve_stack: Stack, method: str, path: str, allow: str) -> None:
    status, headers, raw = request(serve_stack.port, method, path, {})
    error_of(status, raw, 405)
    assert allow in [m.strip() for m in headers["allow"].split(",")]


def test_body_over_limit_413(serve_stack: Stack) -> None:
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * (2 * 1024 * 1024)}]}
    status, _, raw = request(serve_stack.port, "POST", CHAT, big)
    error_of(status, raw, 413)

    # chunked transfer encoding: no content-length to check up front
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "demo", "prompt": "'
        for _ in range(40):
            yield b"y" * 65536
        yield b'"}'

    conn = http.client.HTTPConnection("127.0.0.1", serve_stack.port, timeout=30)
    try:
        conn.request(
            "POST",
            COMPLETIONS,
            body=chunks(),
            headers={"content-type": "application/json"},
            encode_chunked=True,
        )
        resp = conn.getresponse()
        error_of(resp.status, resp.read(), 413)
    finally:
        conn.close()
    # just under the limit is fine (then refused only for its length in tokens, or served)
    status, _, raw = request(
        serve_stack.port,
        "POST",
        COMPLETIONS,
        {"model": MODEL, "prompt": "z " * 1000, "max_tokens": 2},
    )
    assert status == 200, raw


def test_server_survives_garbage(serve_stack: Stack) -> None:
    """After all the errors above, the same connection still serves good requests."""
    conn = http.client.HTTPConnection("127.0.0.1", serve_stack.port, timeout=30)
    try:
        for raw in (b"{", b'{"model": "demo", "messages": []}'):
            conn.request("POST", CHAT, body=raw, headers={"content-type": "application/json"})
            resp = conn.getresponse()
            body = resp.read()
            assert resp.status in (200, 400) and b"Traceback" not in body
        good = json.dumps({"model": MODEL, "messages": MSGS, "max_tokens": 2}).encode()
        conn.request("POST", CHAT, body=good, headers={"content-type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        resp.read()
    finally:
        conn.close()
