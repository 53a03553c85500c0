"""Worker-side publishing of KV events and load metrics, and the KV recovery endpoint.

Engines hand their per-pass batches to :meth:`KVPublisher.publish_kv` / :meth:`publish_load`
(the mocker's sinks). Each batch first goes through the worker-local index
(:class:`dynamo.router.local_index.LocalKVIndex`: the worker's block set plus a bounded buffer of
recent events), then onto the event plane: topics ``kv-events`` (``KVEventBatch``) and
``kv_metrics`` (``WorkerLoad``), msgpack. Routers that detect a gap (or start late) ask the
``kv_recovery`` endpoint of the worker's component for the tail or a full dump.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec

from dynamo.protocol.kv_events import (
    KV_EVENTS_TOPIC,
    RECOVERY_ENDPOINT,
    KVEventBatch,
    KVRecoveryRequest,
)
from dynamo.protocol.kv_wire import encode_batch
from dynamo.protocol.load import LOAD_TOPIC, WorkerLoad
from dynamo.router.local_index import LocalKVIndex
from dynamo.runtime.context import Context
from dynamo.runtime.errors import InvalidArgument
from dynamo.runtime.naming import EndpointId
from dynamo.runtime.request_plane.base import Handler
from dynamo.runtime.runtime import DistributedRuntime

_encoder = msgspec.msgpack.Encoder()
_recovery_decoder = msgspec.msgpack.Decoder(KVRecoveryRequest)


def recovery_endpoint(generate_endpoint: EndpointId) -> EndpointId:
    """The recovery endpoint that sits beside a worker's generate endpoint."""
    return EndpointId(generate_endpoint.namespace, generate_endpoint.component, RECOVERY_ENDPOINT)


class KVPublisher:
    """Bound to a runtime; usable once the runtime has started (engines publish after start)."""

    def __init__(self, runtime: DistributedRuntime, *, buffer_size: int = 1024) -> None:
        self._runtime = runtime
        self._buffer_size = buffer_size
        self._indexes: dict[int, LocalKVIndex] = {}
        self.num_batches = 0

    @property
    def runtime(self) -> DistributedRuntime:
        """The worker's runtime (engines' other per-worker services use it too)."""
        return self._runtime

    def local_index(self, worker_id: int) -> LocalKVIndex:
        index = self._indexes.get(worker_id)
        if index is None:
            index = LocalKVIndex(worker_id, buffer_size=self._buffer_size)
            self._indexes[worker_id] = index
        return index

    async def publish_kv(self, batch: KVEventBatch) -> None:
        if not batch.events:
            return
        index = self.local_index(batch.worker_id)
        for event in batch.events:
            index.apply(event)
        self.num_batches += 1
        await self._runtime.events.publish(KV_EVENTS_TOPIC, encode_batch(batch))

    async def publish_load(self, load: WorkerLoad) -> None:
        await self._runtime.events.publish(LOAD_TOPIC, _encoder.encode(load))

    async def serve_recovery(self, generate_endpoint: EndpointId, worker_ids: list[int]) -> None:
        """Register each worker's recovery endpoint (instance id = worker id)."""
        endpoint = recovery_endpoint(generate_endpoint)
        for worker_id in worker_ids:
            index = self.local_index(worker_id)
            await self._runtime.serve_endpoint(
                endpoint, self._recovery_handler(index), instance_id=worker_id
            )

    @staticmethod
    def _recovery_handler(index: LocalKVIndex) -> Handler:
        async def handle(body: bytes, ctx: Context) -> AsyncIterator[bytes]:
            try:
                request = _recovery_decoder.decode(body)
            except msgspec.DecodeError as exc:
                raise InvalidArgument(f"malformed recovery request: {exc}") from exc
            yield _encoder.encode(index.answer(request))

        return handle
