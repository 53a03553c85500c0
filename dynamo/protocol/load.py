"""Worker load metrics published on the event plane (topic ``kv_metrics``)."""

from __future__ import annotations

import msgspec

LOAD_TOPIC = "kv_metrics"
"""Event-plane topic of ``WorkerLoad`` messages (msgpack)."""


class WorkerLoad(msgspec.Struct, kw_only=True, omit_defaults=True):
    worker_id: int
    dp_rank: int = 0
    active_decode_blocks: int = 0
    total_blocks: int = 0
    num_waiting: int = 0
    num_running: int = 0
    kv_usage: float = 0.0
