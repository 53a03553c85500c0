"""A request's router-queue priority (FACTS §4.5): from ``nvext.agent_hints`` or the
``x-dynamo-request-priority`` / ``x-dynamo-request-strict-priority`` headers.

The body's value wins over the header's when both are given. A malformed header is a 400, as a
malformed body field would be: a priority that is silently dropped would be a hint ignored.
"""

from __future__ import annotations

import math

from dynamo.protocol.openai import NvExt
from dynamo.runtime.errors import InvalidArgument

PRIORITY_HEADER = "x-dynamo-request-priority"
STRICT_PRIORITY_HEADER = "x-dynamo-request-strict-priority"
_MAX_JUMP = 1e9
_MAX_STRICT = (1 << 32) - 1

PriorityHeaders = tuple[str | None, str | None]
"""The raw values of the two headers (None: absent)."""


def request_priority(nvext: NvExt | None, headers: PriorityHeaders) -> tuple[float, int]:
    """``(priority_jump, strict_priority)`` of a request (0, 0 when none is given). Raises
    ``InvalidArgument`` for a header that is not a number in range."""
    hints = nvext.agent_hints if nvext is not None else None
    jump = hints.priority if hints is not None else None
    strict = hints.strict_priority if hints is not None else None
    raw_jump, raw_strict = headers
    if jump is None and raw_jump is not None:
        jump = _parse_jump(raw_jump)
    if strict is None and raw_strict is not None:
        strict = _parse_strict(raw_strict)
    return (jump or 0.0, strict or 0)


def _parse_jump(raw: str) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= _MAX_JUMP:  # also NaN
        raise InvalidArgument(
            f"{PRIORITY_HEADER} must be a number from 0 to {_MAX_JUMP:g}, not {raw[:40]!r}",
            param=PRIORITY_HEADER,
        )
    return value


def _parse_strict(raw: str) -> int:
    text = raw.strip()
    if not (text.isascii() and text.isdigit()) or int(text) > _MAX_STRICT:
        raise InvalidArgument(
            f"{STRICT_PRIORITY_HEADER} must be an integer from 0 to {_MAX_STRICT}, "
            f"not {raw[:40]!r}",
            param=STRICT_PRIORITY_HEADER,
        )
    return int(text)
