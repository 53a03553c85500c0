"""The KV-cache-aware router of one model: an async shell over ``router/core.py``.

``RoutingCore`` decides (index, active load, selection) synchronously; this shell feeds it what
only a live process has: KV event batches from the event plane, recovery of a worker rank's
index after a gap or when a worker joins, replica sync with other routers, and metrics.

Background tasks (owned here, cancelled by :meth:`close`): applying KV event batches, recovering a
worker rank's index, the cache-consistency check, watching which workers lack their KV query
endpoint (``event_sources.py``), and replica sync. Workers join and leave through
:meth:`KVRouter.add_worker` / :meth:`KVRouter.remove_worker`, called by the frontend's model
registry from its discovery watch.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Coroutine, Sequence

import msgspec

from dynamo.observability.metrics import RouterMetrics
from dynamo.observability.router_metrics import RouterRequestSeries
from dynamo.protocol.kv_events import (
    KV_EVENTS_TOPIC,
    RECOVERY_ENDPOINT,
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    KVCacheEvent,
    KVRecoveryRequest,
    KVRecoveryResponse,
)
from dynamo.protocol.kv_wire import decode_batch
from dynamo.protocol.model_card import ModelCard
from dynamo.protocol.request import PreprocessedRequest
from dynamo.router.approx import ApproxIndex
from dynamo.router.basic import Selection
from dynamo.router.config import KVRouterSettings
from dynamo.router.consistency import RankConsistency, drift_blocks
from dynamo.router.core import RoutingCore, WorkerSpec
from dynamo.router.event_sources import EventSourceMonitor
from dynamo.router.hashing import local_block_hashes, sequence_hashes
from dynamo.router.indexer import EventStatus, KVIndexer
from dynamo.router.replica_sync import RouterReplicaSync, SyncEvent, SyncOp, apply_sync_event
from dynamo.router.sequences import ActiveSequences
from dynamo.router.waiting import RouterQueue
from dynamo.runtime.client import EndpointClient
from dynamo.runtime.context import Context
from dynamo.runtime.errors import NoInstances
from dynamo.runtime.event_plane.base import StoredEventPlane, Subscription
from dynamo.runtime.naming import EndpointId
from dynamo.runtime.runtime import DistributedRuntime

log = logging.getLogger(__name__)

MAX_RECOVERY_ATTEMPTS = 3
HISTORY_WINDOW_S = 10.0  # how long stored events wait for their worker to be discovered
HISTORY_MAX_EVENTS = 100_000  # per worker; beyond, that worker is asked for a dump
CONSISTENCY_ATTEMPTS = 5  # digest requests per rank per round while events are in flight

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
        series: RouterRequestSeries | None = None,
    ) -> None:
        self._runtime = runtime
        self.model = model
        self.block_size = block_size
        self.settings = settings
        self._metrics = metrics
        self.series = series
        """This router's ``dynamo_component_router_*`` series (the frontend's, per model)."""
        self.core = RoutingCore(block_size, settings, rng=rng or random.Random())
        self._workers: dict[int, ModelCard] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._events_task: asyncio.Task[None] | None = None
        self._sub: Subscription | None = None
        self._recovery: EndpointClient | None = None
        self._sync: RouterReplicaSync | None = None
        # Stored KV events by worker, read at start (JetStream), for workers not added yet:
        # applied when discovery adds them, in place of asking each for a dump.
        self._history: dict[int, list[KVCacheEvent]] | None = None
        self.consistency: dict[tuple[int, int], RankConsistency] = {}
        """The latest cache-consistency check per worker rank (``check_consistency``)."""
        self.event_sources = EventSourceMonitor(model)
        """Which workers lack their KV query endpoint (watched while KV events are followed)."""
        self.queue: RouterQueue | None = (
            RouterQueue(self) if settings.queue_threshold is not None else None
        )
        """The router queue (``--router-queue-threshold``): requests held for capacity."""

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
        series: RouterRequestSeries | None = None,
    ) -> KVRouter:
        router = cls(
            runtime,
            card.served_model_name,
            card.kv_block_size,
            settings,
            metrics,
            series=series,
        )
        await router.start(EndpointId(card.namespace, card.component, card.endpoint))
        return router

    async def start(self, generate_endpoint: EndpointId) -> None:
        if self.indexer is not None:
            recovery = EndpointId(
                generate_endpoint.namespace, generate_endpoint.component, RECOVERY_ENDPOINT
            )
            self._recovery = await self._runtime.client(recovery)
            self._sub = await self._runtime.events.subscribe(KV_EVENTS_TOPIC)
            events = self._runtime.events
            if isinstance(events, StoredEventPlane):
                await self._load_history(events)
            self._events_task = asyncio.create_task(
                self._follow_events(), name=f"kv-router-events:{self.model}"
            )
            if self.settings.consistency_check_interval_s > 0:
                self._spawn(self._check_loop(), f"kv-router-consistency:{self.model}")
            publish = self.series.event_source_mismatches if self.series is not None else None
            watch = self.event_sources.watch(self._workers, self._recovery.instance_ids, publish)
            self._spawn(watch, f"kv-router-event-sources:{self.model}")
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
        for worker_id in list(self._workers):  # the model retired: its ranks are unregistered
            self.remove_worker(worker_id)
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
        """Choose a worker rank and count the request's load there. Each phase is timed into the
        ``dynamo_router_overhead_*_ms`` histograms (hashing, find_matches, the rest as
        scheduling)."""
        started = time.perf_counter()
        for card in candidates:  # normally known already (add_worker from discovery)
            if card.instance_id not in self._workers:
                self.add_worker(card)
        if not candidates:
            raise NoInstances("no live instance")
        request_id = request.request_id or ""
        begun = time.perf_counter()
        local = local_block_hashes(request.token_ids, self.block_size, lora_name=request.lora_name)
        hashed = time.perf_counter()
        seqs = sequence_hashes(local)
        seq_hashed = time.perf_counter()
        overlaps = self.core.find_matches(local)
        matched = time.perf_counter()
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
            overlaps=overlaps,
            prefix_keys=(prefix := self.core.prefix_keys(seqs)),  # chained once: route + record
        )
        if not self.core.record(request_id, chosen, seqs, isl, local, prefix):
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
            done = time.perf_counter()
            overhead = self._metrics.overhead_ms
            overhead["block_hashing"].observe((hashed - begun) * 1000.0)
            overhead["seq_hashing"].observe((seq_hashed - hashed) * 1000.0)
            overhead["indexer_find_matches"].observe((matched - seq_hashed) * 1000.0)
            overhead["scheduling"].observe((done - matched) * 1000.0)
            overhead["total"].observe((done - started) * 1000.0)
            self._metrics.kv_hit_rate.labels(self.model).observe(
                chosen.cached_tokens / isl if isl else 0.0
            )
        if self.series is not None:  # a pinned request had no choice: it loses no overlap
            pinned = hints is not None and (hints.backend_instance_id, hints.dp_rank) != (
                None,
                None,
            )
            among = None if pinned else [overlaps.get(key, 0) for key in chosen.scored]
            self.series.routed(isl, chosen.overlap_blocks, self.block_size, among)
        return Selection(chosen.worker_id, chosen.dp_rank, chosen.overlap_blocks, chosen.cost)

    def on_first_token(self, request_id: str) -> None:
        if self.core.prefill_completed(request_id):
            if self._sync is not None:
                self._sync.publish(SyncOp.PREFILL_COMPLETED, request_id)
            if self.queue is not None:
                self.queue.drain()

    def on_finish(self, request_id: str) -> None:
        if self.core.free(request_id):
            if self._sync is not None:
                self._sync.publish(SyncOp.FREE, request_id)
            if self.queue is not None:
                self.queue.drain()

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
        if self.series is not None:
            for rank in spec.ranks:
                self.series.worker_registered(worker_id, rank, True)
        if self.indexer is not None and self._recovery is not None:
            stored = self._history.pop(worker_id, None) if self._history is not None else None
            for event in stored or ():
                self.indexer.apply(worker_id, event)
            for rank in spec.ranks:
                if (
                    stored
                    and self.indexer.last_event_id(worker_id, rank) is not None
                    and not self.indexer.is_recovering(worker_id, rank)
                ):
                    continue  # the stored events were complete: nothing to ask the worker
                self._spawn_recovery(worker_id, rank)
        if self.queue is not None:
            self.queue.drain()  # a new worker's capacity

    async def _load_history(self, events: StoredEventPlane) -> None:
        """Read the stored KV events (before following live ones) into ``_history``; kept for
        ``HISTORY_WINDOW_S`` (discovery reports the live workers well within it)."""
        history: dict[int, list[KVCacheEvent]] = {}
        async for message in events.replay(KV_EVENTS_TOPIC):
            try:
                batch = decode_batch(message.payload)
            except (msgspec.DecodeError, ValueError):
                continue
            if batch is not None:
                _record(history, batch.worker_id, batch.events)
        self._history = history
        asyncio.get_running_loop().call_later(HISTORY_WINDOW_S, self._drop_history)

    def _drop_history(self) -> None:
        self._history = None

    def remove_worker(self, instance_id: int) -> None:
        """Forget a departed worker: its index and load."""
        card = self._workers.pop(instance_id, None)
        if card is None:
            return
        self.core.remove_worker(instance_id)
        if self.series is not None:
            for rank in range(
                card.data_parallel_start_rank,
                card.data_parallel_start_rank + card.data_parallel_size,
            ):
                self.series.worker_registered(instance_id, rank, False)
        if self.queue is not None:
            self.queue.drain()  # a saturated worker gone: the others may take the front
        for key in [k for k in self.consistency if k[0] == instance_id]:
            del self.consistency[key]
            if self._metrics is not None:
                labels = (self.model, f"{instance_id:x}", str(key[1]))
                try:
                    self._metrics.kv_index_drift.remove(*labels)
                except KeyError:
                    pass

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
            if batch is None:
                continue
            if batch.worker_id not in self._workers:
                if self._history is not None:  # not discovered yet: keep after the stored ones
                    _record(self._history, batch.worker_id, batch.events)
                continue  # another model's worker (ours are added from discovery)
            applied = self._metrics.events_applied if self._metrics is not None else None
            for event in batch.events:
                status = indexer.apply(batch.worker_id, event)
                if status is EventStatus.GAP:
                    self._spawn_recovery(batch.worker_id, event.dp_rank)
                if applied is not None:
                    applied.labels(status.value, _EVENT_TYPE[type(event.data)]).inc()

    def _spawn_recovery(self, worker_id: int, rank: int) -> None:
        self._spawn(self._recover(worker_id, rank), f"kv-recovery:{worker_id:x}:{rank}")

    def _spawn(self, work: Coroutine[object, object, None], name: str) -> None:
        task = asyncio.get_running_loop().create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _ask(self, worker_id: int, request: KVRecoveryRequest) -> KVRecoveryResponse | None:
        """One request to the worker's local index (its ``kv_recovery`` endpoint)."""
        assert self._recovery is not None
        await self._recovery.wait_for_instances(1, timeout=5)
        response: KVRecoveryResponse | None = None
        stream = self._recovery.stream(_encoder.encode(request), Context(), instance_id=worker_id)
        async for raw in stream:
            response = _recovery_decoder.decode(raw)
        return response

    async def _recover(self, worker_id: int, rank: int, *, full: bool = False) -> None:
        """Ask the worker's local index for the missed tail (or a dump: ``full``) and ingest
        it."""
        assert self.indexer is not None and self._recovery is not None
        indexer = self.indexer
        try:
            for _ in range(MAX_RECOVERY_ATTEMPTS):
                if worker_id not in self._workers:
                    indexer.cancel_recovery(worker_id, rank)
                    return
                request = indexer.recovery_request(worker_id, rank, full=full)
                try:
                    response = await self._ask(worker_id, request)
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

    # -- cache consistency (router/consistency.py) ---------------------------------------------
    async def _check_loop(self) -> None:
        interval = self.settings.consistency_check_interval_s
        while True:
            await asyncio.sleep(interval)
            try:
                await self.check_consistency()
            except Exception:
                log.exception("KV consistency check failed")

    async def check_consistency(self) -> list[RankConsistency]:
        """Compare the index with each worker rank's local index; resync a rank that drifted.
        Returns the ranks checked this round (a rank with events in flight or in recovery is
        skipped until the next round)."""
        if self.indexer is None or self._recovery is None:
            return []
        checked: list[RankConsistency] = []
        for worker_id, rank in self.indexer.workers():
            if worker_id not in self._workers or self.indexer.is_recovering(worker_id, rank):
                continue
            try:
                state = await self._check_rank(worker_id, rank)
            except Exception as exc:  # the worker went away mid-check, a timeout, ...
                log.info("KV consistency check of worker %x skipped: %s", worker_id, exc)
                continue
            if state is not None:
                checked.append(state)
        return checked

    async def _check_rank(self, worker_id: int, rank: int) -> RankConsistency | None:
        indexer = self.indexer
        assert indexer is not None
        request = KVRecoveryRequest(dp_rank=rank, digest_only=True)
        for attempt in range(CONSISTENCY_ATTEMPTS):
            if attempt:
                await asyncio.sleep(0.05)  # events in flight: let them land
            response = await self._ask(worker_id, request)
            if response is None or response.num_blocks is None or response.digest is None:
                return None  # a worker that does not answer digests
            if indexer.is_recovering(worker_id, rank) or worker_id not in self._workers:
                return None
            if indexer.last_event_id(worker_id, rank) == response.last_event_id:
                break
        else:
            return None
        mine = indexer.digest(worker_id, rank)
        drift = drift_blocks(mine, (response.num_blocks, response.digest))
        previous = self.consistency.get((worker_id, rank))
        state = RankConsistency(
            worker_id,
            rank,
            router_blocks=mine[0],
            worker_blocks=response.num_blocks,
            drift_blocks=drift,
            last_event_id=response.last_event_id,
            resyncs=previous.resyncs if previous is not None else 0,
        )
        self.consistency[(worker_id, rank)] = state
        if self._metrics is not None:
            self._metrics.kv_index_drift.labels(self.model, f"{worker_id:x}", str(rank)).set(drift)
        if drift:
            log.warning(
                "KV index of worker %x rank %d drifted (%d blocks here, %d there): resyncing",
                worker_id,
                rank,
                mine[0],
                response.num_blocks,
            )
            state.resyncs += 1
            if self._metrics is not None:
                self._metrics.kv_index_resyncs.labels(self.model, f"{worker_id:x}").inc()
            await self._recover(worker_id, rank, full=True)
        return state

    # -- replica sync --------------------------------------------------------------------------
    def _apply_sync(self, event: SyncEvent) -> None:
        apply_sync_event(self.sequences, event)
        if self.queue is not None and event.op is not SyncOp.ADD:
            self.queue.drain()  # another router's request left our workers' load


def _record(
    history: dict[int, list[KVCacheEvent]], worker_id: int, events: list[KVCacheEvent]
) -> None:
    """Append, bounded: a worker with too long a history is dropped (it gets a dump instead)."""
    kept = history.setdefault(worker_id, [])
    if len(kept) + len(events) > HISTORY_MAX_EVENTS:
        history[worker_id] = []
        return
    kept.extend(events)
