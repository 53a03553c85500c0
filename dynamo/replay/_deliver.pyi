"""Type stub of the native module ``dynamo.replay._deliver`` (source: ``_deliver.c``; the same
contract in Python: ``_deliver_fallback.py``). Import through ``dynamo.replay.deliver``."""

from typing import Any

def deliver(tokens: list[tuple[Any, int]], by_id: dict[str, Any], now: float) -> list[Any] | None:
    """For each ``(seq, token)`` of a pass ending at ``now`` whose request ``by_id[
    seq.request_id]`` is still there (absent: abandoned while the pass ran, skipped): its
    record's first token (``record.ttft = now - record.start``) or next gap
    (``record.itl.append(now - flight.last_token_at)``), then ``flight.last_token_at = now``
    and ``record.output_tokens += 1``. Returns the flights whose first token this was, in
    order, or None when there are none. TypeError unless ``tokens`` is a list of pairs and
    ``by_id`` a dict; an attribute's error propagates (the tokens before it are delivered)."""
