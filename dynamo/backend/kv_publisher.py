"""Worker-side publishing of KV events and load metrics on the event plane.

Engines hand their per-pass batches to :meth:`KVPublisher.publish_kv` / :meth:`publish_load`
(the mocker's sinks). Topics: ``kv-events`` (``KVEventBatch``) and ``kv_metrics``
(``WorkerLoad``), msgpack-encoded. Publishing never blocks on subscribers.
"""

from __future__ import annotations

import msgspec

from dynamo.protocol.kv_events import KVEventBatch
from dynamo.protocol.load import WorkerLoad
from dynamo.runtime.runtime import DistributedRuntime

KV_EVENTS_TOPIC = "kv-events"
LOAD_TOPIC = "kv_metrics"

_encoder = msgspec.msgpack.Encoder()


class KVPublisher:
    """Bound to a runtime; usable once the runtime has started (engines publish after start)."""

    def __init__(self, runtime: DistributedRuntime) -> None:
        self._runtime = runtime
        self.num_batches = 0

    async def publish_kv(self, batch: KVEventBatch) -> None:
        if not batch.events:
            return
        self.num_batches += 1
        await self._runtime.events.publish(KV_EVENTS_TOPIC, _encoder.encode(batch))

    async def publish_load(self, load: WorkerLoad) -> None:
        await self._runtime.events.publish(LOAD_TOPIC, _encoder.encode(load))
