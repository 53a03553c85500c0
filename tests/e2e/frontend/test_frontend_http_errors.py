"""Every client-visible error of the frontend: status, headers and the OpenAI error body
``{"error": {"message", "type", "param", "code"}}``; never a 500 with a traceback."""

from __future__ import annotations

import http.client
import json
import socket
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
    # a prompt that fits but leaves no room for max_tokens is refused with the lengths (vLLM)
    status, _, raw = request(
        serve_stack.port,
        "POST",
        COMPLETIONS,
        {"model": MODEL, "prompt": [100] * 8185, "max_tokens": 1000},
    )
    err = error_of(status, raw, 400)
    assert "1000 > 8192 - 8185" in err["message"], err
    status, _, raw = request(
        serve_stack.port,
        "POST",
        COMPLETIONS,
        {"model": MODEL, "prompt": [100] * 8185, "max_tokens": 7},
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


def _raw_exchange(port: int, head: bytes, parts: Iterator[bytes]) -> tuple[int, bytes]:
    """Send a request head and body parts on a raw socket, then read the response."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head)
        for part in parts:
            sock.sendall(part)
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        try:
            return resp.status, resp.read()
        finally:
            resp.close()


LIMIT = 1024 * 1024  # the fixture's --body-limit-mb 1


def test_body_over_limit_413(serve_stack: Stack) -> None:
    # a declared length over the limit is refused before the body is read
    head = (
        f"POST {CHAT} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {2 * LIMIT}\r\n\r\n"
    ).encode()
    status, raw = _raw_exchange(serve_stack.port, head, iter(()))
    error_of(status, raw, 413)

    # chunked transfer encoding (no length declared): refused once the body passes the limit
    head = (
        f"POST {COMPLETIONS} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        "transfer-encoding: chunked\r\n\r\n"
    ).encode()

    def parts() -> Iterator[bytes]:
        for _ in range(LIMIT // 65536):
            yield b"10000\r\n" + b"y" * 65536 + b"\r\n"
        yield b"1\r\ny\r\n"  # one byte over; the terminating chunk is never sent

    status, raw = _raw_exchange(serve_stack.port, head, parts())
    error_of(status, raw, 413)

    # a chunked body within the limit is read whole and served
    def small() -> Iterator[bytes]:
        yield b'{"model": "demo", '
        yield b'"prompt": "' + b"w " * 500 + b'", '
        yield b'"max_tokens": 2}'

    conn = http.client.HTTPConnection("127.0.0.1", serve_stack.port, timeout=30)
    try:
        conn.request(
            "POST",
            COMPLETIONS,
            body=small(),
            headers={"content-type": "application/json"},
            encode_chunked=True,
        )
        resp = conn.getresponse()
        out = resp.read()
        assert resp.status == 200, out
        assert json.loads(out)["usage"]["completion_tokens"] == 2
    finally:
        conn.close()
    # just under the limit with a declared length is fine
    status, _, raw = request(
        serve_stack.port,
        "POST",
        COMPLETIONS,
        raw=b'{"model": "demo", "max_tokens": 1, "prompt": "z", "pad": "'
        + b"p" * (LIMIT - 200)
        + b'"}',
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
