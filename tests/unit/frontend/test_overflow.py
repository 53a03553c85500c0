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


async def read_all(sock: socket.socket) -> bytes:
    sock.settimeout(10)
    answer = b""
    while chunk := await asyncio.to_thread(sock.recv, 65536):
        answer += chunk
    return answer


async def test_waiting_connections_are_refused_only_when_the_server_is_full() -> None:
    listener = socket.create_server(("127.0.0.1", 0), backlog=16)
    port = listener.getsockname()[1]
    refuser = OverflowRefuser(listener.fileno(), port, max_connections=1, grace_s=0.2)
    refuser.start()
    try:
        # A connection that waits while the "server" (this test) has room: not refused.
        early = socket.create_connection(("127.0.0.1", port))
        await asyncio.sleep(0.6)  # several grace periods
        assert refuser.refused == 0 and accept_queue_length(listener) == 1
        served, _ = listener.accept()  # the server takes it late: its one place is used now
        served.setblocking(False)
        with pytest.raises(BlockingIOError):
            served.recv(1)  # open, and nothing was written to it
        # Two more connections nobody accepts while the server is full: answered 503.
        waiting = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        waiting[0].sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        for sock in waiting:
            assert await read_all(sock) == refusal_response()
            sock.close()
        assert refuser.refused == 2 and accept_queue_length(listener) == 0
        served.close()
        early.close()
    finally:
        await refuser.close()
        listener.close()
    with pytest.raises(ValueError):
        OverflowRefuser(0, 0, 1, grace_s=0)
