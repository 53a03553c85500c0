"""The nvext ``timing`` response field: when the request arrived and how long it took.

Asked with ``nvext.annotations: ["timing"]`` (spec 004) or ``nvext.extra_fields: ["timing"]``
(FACTS §10); returned as ``nvext.timing`` on the final chunk of a stream and in a unary
response, with the reference's ``TimingInfo`` field names. Measured by the frontend (from the
moment the HTTP request arrived), so every engine supports it.
"""

from __future__ import annotations

import time

import msgspec


class TimingInfo(msgspec.Struct, omit_defaults=True, kw_only=True):
    """``request_received_ms``: Unix epoch milliseconds; durations in milliseconds. ``ttft_ms``
    is absent when no token was generated; ``kv_hit_rate`` (cached / prompt tokens) when the
    engine reported no cached-token count."""

    request_received_ms: int
    ttft_ms: float | None = None
    total_time_ms: float
    kv_hit_rate: float | None = None


def timing_info(
    *,
    started: float,
    first_token_at: float | None,
    prompt_tokens: int,
    cached_tokens: int | None,
    now: float | None = None,
) -> TimingInfo:
    """Timing of a request that arrived at ``started`` (``time.monotonic()``), as of ``now``."""
    mono = time.monotonic() if now is None else now
    received_ms = int((time.time() - (mono - started)) * 1000)
    ttft = None if first_token_at is None else round((first_token_at - started) * 1000, 3)
    hit = None
    if cached_tokens is not None and prompt_tokens > 0:
        hit = round(cached_tokens / prompt_tokens, 4)
    return TimingInfo(
        request_received_ms=received_ms,
        ttft_ms=ttft,
        total_time_ms=round((mono - started) * 1000, 3),
        kv_hit_rate=hit,
    )
