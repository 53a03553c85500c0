"""OverflowRefuser on a real loopback listener: a connection nobody accepts within the grace
period is answered 503 and closed; one that the server accepts in time is left alone."""

from __future__ import annotations

import asyncio
import json
import socket
import sys

import pytest

from dynamo.frontend.overflow import OverflowRefuser, accept_queue_length, refusal_response

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads Linux's TCP_INFO")


def test_refusal_response_is_a_complete_openai_503() -> None:
    head, _, body = refusal_response().partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "HTTP/1.1 503 Service Unavailable"
    assert f"content-length: {len(body)}" in lines
    assert "connection: close" in lines and "retry-after: 1" in lines
    assert json.loads(body)["error"]["type"] == "service_unavailable"


async def test_waiting_connections_are_refused_taken_ones_are_not() -> None:
    listener = socket.create_server(("127.0.0.1", 0), backlog=16)
    port = listener.getsockname()[1]
    refuser = OverflowRefuser(listener.fileno(), grace_s=0.2)
    refuser.start()
    try:
        # A connection the "server" takes at once: never refused.
        served = socket.create_connection(("127.0.0.1", port))
        taken, _ = listener.accept()
        await asyncio.sleep(0.5)
        assert refuser.refused == 0
        taken.setblocking(False)
        with pytest.raises(BlockingIOError):
            taken.recv(1)  # open, nothing was written to it
        taken.close()
        served.close()
        # Two connections nobody accepts: answered 503 after the grace period.
        waiting = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        waiting[0].sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        for sock in waiting:
            sock.settimeout(10)
            answer = b""
            while chunk := await asyncio.to_thread(sock.recv, 65536):
                answer += chunk
            assert answer == refusal_response()
            sock.close()
        assert refuser.refused == 2 and accept_queue_length(listener) == 0
    finally:
        refuser.close()
        listener.close()
    with pytest.raises(ValueError):
        OverflowRefuser(0, grace_s=0)
