"""HTTP/1.1 response heads of the small HTTP server (``http_server.py``) and its native path.

Keep-alive JSON answers are ``PREFIXES[status]`` + decimal body length + CRLF CRLF + body (one
format in Python, a few copies in ``_http.c``); everything else goes through ``render``.
"""

from __future__ import annotations

import http

REASONS = {
    100: b"100 Continue",
    200: b"200 OK",
    201: b"201 Created",
    400: b"400 Bad Request",
    404: b"404 Not Found",
    405: b"405 Method Not Allowed",
    408: b"408 Request Timeout",
    409: b"409 Conflict",
    413: b"413 Payload Too Large",
    415: b"415 Unsupported Media Type",
    422: b"422 Unprocessable Entity",
    431: b"431 Request Header Fields Too Large",
    500: b"500 Internal Server Error",
    503: b"503 Service Unavailable",
}
JSON_TYPE = b"application/json"
PREFIXES = {
    status: b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: " % reason
    for status, reason in REASONS.items()
}


_OTHER_REASONS: dict[int, bytes] = {}


def reason(status: int) -> bytes:
    """``<status> <phrase>`` of a status line: ``REASONS``', else the standard phrase (529, not
    in the standard, is the reference's "Site Overloaded")."""
    known = REASONS.get(status) or _OTHER_REASONS.get(status)
    if known is None:
        try:
            phrase = http.HTTPStatus(status).phrase
        except ValueError:
            phrase = "Site Overloaded" if status == 529 else "Status"
        known = _OTHER_REASONS[status] = b"%d %s" % (status, phrase.encode())
    return known


def render_keep_alive(result: tuple[int, bytes] | tuple[int, bytes, bytes]) -> bytes:
    """A keep-alive answer to a native-path request that has no pre-rendered head."""
    media_type = result[2] if len(result) == 3 else JSON_TYPE
    return render(result[0], result[1], content_type=media_type)


def render(
    status: int,
    body: bytes,
    *,
    close: bool = False,
    head: bool = False,
    content_type: bytes = JSON_TYPE,
) -> bytes:
    """One HTTP/1.1 response (keep-alive JSON answers take ``PREFIXES``)."""
    line = reason(status)
    conn = b"connection: close\r\n" if close else b""
    if not body:
        return b"HTTP/1.1 %s\r\n%scontent-length: 0\r\n\r\n" % (line, conn)
    return b"HTTP/1.1 %s\r\ncontent-type: %s\r\n%scontent-length: %d\r\n\r\n%s" % (
        line,
        content_type,
        conn,
        len(body),
        b"" if head else body,
    )
