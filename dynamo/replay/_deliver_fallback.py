"""The pure-Python twin of ``dynamo.replay._deliver`` (the same contract: ``_deliver.pyi``);
``dynamo.replay.deliver`` picks one. This loop is the definition the native module follows."""

from __future__ import annotations

from typing import Any


def deliver(tokens: list[tuple[Any, int]], by_id: dict[str, Any], now: float) -> list[Any] | None:
    """A pass's tokens (ending at ``now``) into the records of the flights in ``by_id``; the
    flights whose first token this was, in order (None if none)."""
    firsts: list[Any] | None = None
    for seq, _token in tokens:
        flight = by_id.get(seq.request_id)
        if flight is None:
            continue  # abandoned while the pass ran
        record = flight.record
        if record.ttft is None:
            record.ttft = now - record.start
            if firsts is None:
                firsts = [flight]
            else:
                firsts.append(flight)
        else:
            record.itl.append(now - flight.last_token_at)
        flight.last_token_at = now
        record.output_tokens += 1
    return firsts
