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
    """``request_received_ms``: Unix epoch milliseconds; durations in milliseconds.
    ``prefill_wait_time_ms``: arrival to dispatch (parse, tokenize, route); ``prefill_time_ms``:
    dispatch to first token; their sum is ``ttft_ms``. A field is absent when its moment never
    came (no token, never dispatched); ``kv_hit_rate`` (cached / prompt tokens) when the engine
    reported no cached-token count."""

    request_received_ms: int
    prefill_wait_time_ms: float | None = None
    prefill_time_ms: float | None = None
    ttft_ms: float | None = None
    total_time_ms: float
    kv_hit_rate: float | None = None


def timing_info(
    *,
    started: float,
    dispatched_at: float | None,
    first_token_at: float | None,
    prompt_tokens: int,
    cached_tokens: int | None,
    now: float | None = None,
) -> TimingInfo:
    """Timing of a request that arrived at ``started`` (``time.monotonic()``, as are the other
    moments), as of ``now``."""
    mono = time.monotonic() if now is None else now
    received_ms = int((time.time() - (mono - started)) * 1000)
    ttft = _ms(started, first_token_at)
    hit = None
    if cached_tokens is not None and prompt_tokens > 0:
        hit = round(cached_tokens / prompt_tokens, 4)
    return TimingInfo(
        request_received_ms=received_ms,
        prefill_wait_time_ms=_ms(started, dispatched_at),
        prefill_time_ms=_ms(dispatched_at, first_token_at),
        ttft_ms=ttft,
        total_time_ms=round((mono - started) * 1000, 3),
        kv_hit_rate=hit,
    )


def _ms(start: float | None, end: float | None) -> float | None:
    if start is None or end is None:
        return None
    return round((end - start) * 1000, 3)
