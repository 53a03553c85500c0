"""The KV-cache-aware router of one model: an async shell over ``router/core.py``.

``RoutingCore`` decides (index, active load, selection) synchronously; this shell feeds it what
only a live process has: KV event batches from the event plane, recovery of a worker rank's
index after a gap or when a worker joins, replica sync with other routers, and metrics.

Background tasks (owned here, cancelled by :meth:`close`): applying KV event batches, recovering a
worker rank's index, and replica sync. Workers join and leave through
:meth:`KVRouter.add_worker` / :meth:`KVRouter.remove_worker`, called by the frontend's model
registry from its discovery watch.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Sequence

import msgspec

from dynamo.observability.metrics import RouterMetrics
from dynamo.protocol.kv_events import (
    KV_EVENTS_TOPIC,
    RECOVERY_ENDPOINT,
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    KVRecoveryResponse,
)
from dynamo.protocol.kv_wire import decode_batch
from dynamo.protocol.model_card import ModelCard
from dynamo.protocol.request import PreprocessedRequest
from dynamo.router.approx import ApproxIndex
from dynamo.router.basic import Selection
from dynamo.router.config import KVRouterSettings
from dynamo.router.core import RoutingCore, WorkerSpec
from dynamo.router.hashing import local_block_hashes, sequence_hashes
from dynamo.router.indexer import EventStatus, KVIndexer
from dynamo.router.replica_sync import RouterReplicaSync, SyncEvent, SyncOp
from dynamo.router.sequences import ActiveSequences, DuplicateRequest, UnknownWorkerRank
from dynamo.runtime.client import EndpointClient
from dynamo.runtime.context import Context
from dynamo.runtime.errors import NoInstances
from dynamo.runtime.event_plane.base import Subscription
from dynamo.runtime.naming import EndpointId
from dynamo.runtime.runtime import DistributedRuntime

log = logging.getLogger(__name__)

MAX_RECOVERY_ATTEMPTS = 3

_recovery_decoder = msgspec.msgpack.Decoder(KVRecoveryResponse)
_EVENT_TYPE = {BlocksStored: "stored", BlocksRemoved: "removed", AllBlocksCleared: "cleared"}
_encoder = msgspec.msgpack.Encoder()


class KVRouter:
    """Implements :class:`dynamo.router.basic.Router`. Single owner: the frontend's loop."""

    def __init__(
        self,
        runtime: DistributedRuntime,
        model: str,
        block_size: int,
        settings: KVRouterSettings,
        metrics: RouterMetrics | None = None,
        *,
        rng: random.Random | None = None,
    ) -> None:
        self._runtime = runtime
        self.model = model
        self.block_size = block_size
        self.settings = settings
        self._metrics = metrics
        self.core = RoutingCore(block_size, settings, rng=rng or random.Random())
        self._workers: dict[int, ModelCard] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._events_task: asyncio.Task[None] | None = None
        self._sub: Subscription | None = None
        self._recovery: EndpointClient | None = None
        self._sync: RouterReplicaSync | None = None

    @property
    def indexer(self) -> KVIndexer | None:
        return self.core.indexer

    @property
    def approx(self) -> ApproxIndex | None:
        return self.core.approx

    @property
    def sequences(self) -> ActiveSequences:
        return self.core.sequences

    @classmethod
    async def create(
        cls,
        runtime: DistributedRuntime,
        card: ModelCard,
        settings: KVRouterSettings,
        metrics: RouterMetrics | None = None,
    ) -> KVRouter:
        router = cls(runtime, card.served_model_name, card.kv_block_size, settings, metrics)
        await router.start(EndpointId(card.namespace, card.component, card.endpoint))
        return router

    async def start(self, generate_endpoint: EndpointId) -> None:
        if self.indexer is not None:
            recovery = EndpointId(
                generate_endpoint.namespace, generate_endpoint.component, RECOVERY_ENDPOINT
            )
            self._recovery = await self._runtime.client(recovery)
            self._sub = await self._runtime.events.subscribe(KV_EVENTS_TOPIC)
            self._events_task = asyncio.create_task(
                self._follow_events(), name=f"kv-router-events:{self.model}"
            )
        if self.settings.replica_sync:
            on_drop = self._metrics.replica_sync_dropped.inc if self._metrics is not None else None
            self._sync = RouterReplicaSync(
                self._runtime.events,
                self.model,
                self.block_size,
                self._apply_sync,
                on_drop=on_drop,
            )
            await self._sync.start()

    async def close(self) -> None:
        tasks = list(self._tasks)
        if self._events_task is not None:
            tasks.append(self._events_task)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        self._events_task = None
        if self._sub is not None:
            await self._sub.close()
            self._sub = None
        if self._sync is not None:
            await self._sync.close()
            self._sync = None

    # -- the Router seam -------------------------------------------------------------------
    def select(self, request: PreprocessedRequest, candidates: Sequence[ModelCard]) -> Selection:
        started = time.perf_counter()
        for card in candidates:  # normally known already (add_worker from discovery)
            if card.instance_id not in self._workers:
                self.add_worker(card)
        if not candidates:
            raise NoInstances("no live instance")
        request_id = request.request_id or ""
        local = local_block_hashes(request.token_ids, self.block_size, lora_name=request.lora_name)
        seqs = sequence_hashes(local)
        isl = len(request.token_ids)
        hints = request.routing
        chosen = self.core.route(
            request_id,
            local,
            isl,
            seq_hashes=seqs,
            allowed={card.instance_id for card in candidates},
            pinned_worker=hints.backend_instance_id if hints is not None else None,
            dp_rank=hints.dp_rank if hints is not None else None,
            record=False,
        )
        if not self.core.record(request_id, chosen, seqs, isl, local):
            log.warning("request id %s routed twice; load counted once", request_id)
        if self._sync is not None:
            self._sync.publish(
                SyncOp.ADD,
                request_id,
                chosen.worker_id,
                chosen.dp_rank,
                seqs,
                isl,
                chosen.overlap_blocks,
            )
        if self._metrics is not None:
            self._metrics.decision_seconds.labels(self.model).observe(time.perf_counter() - started)
            self._metrics.kv_hit_rate.labels(self.model).observe(
                chosen.cached_tokens / isl if isl else 0.0
            )
        return Selection(chosen.worker_id, chosen.dp_rank, chosen.overlap_blocks)

    def on_first_token(self, request_id: str) -> None:
        if self.core.prefill_completed(request_id) and self._sync is not None:
            self._sync.publish(SyncOp.PREFILL_COMPLETED, request_id)

    def on_finish(self, request_id: str) -> None:
        if self.core.free(request_id) and self._sync is not None:
            self._sync.publish(SyncOp.FREE, request_id)

    # -- workers (from the frontend's discovery watch) --------------------------------------
    def add_worker(self, card: ModelCard) -> None:
        """Track a new worker: its ranks' load, and its index recovered from its local index
        (so events it published before we heard of it are not lost)."""
        worker_id = card.instance_id
        if worker_id in self._workers:
            return
        self._workers[worker_id] = card
        spec = WorkerSpec(
            worker_id,
            card.data_parallel_start_rank,
            card.data_parallel_size,
            card.total_kv_blocks,
            card.max_num_batched_tokens,
        )
        self.core.add_worker(spec)
        if self.indexer is not None and self._recovery is not None:
            for rank in spec.ranks:
                self._spawn_recovery(worker_id, rank)

    def remove_worker(self, instance_id: int) -> None:
        """Forget a departed worker: its index and load."""
        if self._workers.pop(instance_id, None) is None:
            return
        self.core.remove_worker(instance_id)

    # -- KV events and recovery --------------------------------------------------------------
    async def _follow_events(self) -> None:
        assert self._sub is not None and self.indexer is not None
        indexer = self.indexer
        async for message in self._sub:
            try:
                batch = decode_batch(message.payload)
            except (msgspec.DecodeError, ValueError):
                log.warning("ignoring a malformed kv-events message")
                continue
            if batch is None or batch.worker_id not in self._workers:
                continue  # another model's worker (ours are added from discovery)
            applied = self._metrics.events_applied if self._metrics is not None else None
            for event in batch.events:
                status = indexer.apply(batch.worker_id, event)
                if status is EventStatus.GAP:
                    self._spawn_recovery(batch.worker_id, event.dp_rank)
                if applied is not None:
                    applied.labels(status.value, _EVENT_TYPE[type(event.data)]).inc()

    def _spawn_recovery(self, worker_id: int, rank: int) -> None:
        task = asyncio.get_running_loop().create_task(
            self._recover(worker_id, rank), name=f"kv-recovery:{worker_id:x}:{rank}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _recover(self, worker_id: int, rank: int) -> None:
        """Ask the worker's local index for the missed tail (or a dump) and ingest it."""
        assert self.indexer is not None and self._recovery is not None
        indexer = self.indexer
        try:
            for _ in range(MAX_RECOVERY_ATTEMPTS):
                if worker_id not in self._workers:
                    indexer.cancel_recovery(worker_id, rank)
                    return
                request = indexer.recovery_request(worker_id, rank)
                try:
                    await self._recovery.wait_for_instances(1, timeout=5)
                    response: KVRecoveryResponse | None = None
                    stream = self._recovery.stream(
                        _encoder.encode(request), Context(), instance_id=worker_id
                    )
                    async for raw in stream:
                        response = _recovery_decoder.decode(raw)
                except Exception as exc:
                    log.warning("KV recovery from worker %x failed: %s", worker_id, exc)
                    indexer.cancel_recovery(worker_id, rank)
                    return
                if response is None:
                    indexer.cancel_recovery(worker_id, rank)
                    return
                if indexer.apply_recovery(response) is EventStatus.OK:
                    return
            indexer.cancel_recovery(worker_id, rank)
        except asyncio.CancelledError:
            indexer.cancel_recovery(worker_id, rank)
            raise

    # -- replica sync --------------------------------------------------------------------------
    def _apply_sync(self, event: SyncEvent) -> None:
        if event.op is SyncOp.ADD:
            try:
                self.sequences.add_request(
                    event.request_id,
                    event.worker_id,
                    event.dp_rank,
                    event.sequence_hashes,
                    new_isl_tokens=event.isl_tokens,
                    overlap_blocks=event.overlap_blocks,
                )
            except (DuplicateRequest, UnknownWorkerRank):
                pass
        elif event.op is SyncOp.PREFILL_COMPLETED:
            self.sequences.mark_prefill_completed(event.request_id)
        else:
            self.sequences.free(event.request_id)
