"""The frontend service: HTTP server + runtime + model registry.

The HTTP server is the runtime's (``runtime/http_server.py``) with the frontend's connections
(``http_front.py``: async handlers, streamed responses, its write-behind thread writing them):
it runs in this process's event loop, next to the discovery watches, so handlers share state
with them without locks, and a request reaches its handler without a thread hand-off
(docs/performance.md, "HTTP server choice").
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import tempfile
from collections.abc import Iterator
from pathlib import Path

from dynamo.frontend.admission import Admission
from dynamo.frontend.attempt import Timeouts
from dynamo.frontend.config import FrontendConfig
from dynamo.frontend.dashboard import Dashboard
from dynamo.frontend.disagg import Disaggregation
from dynamo.frontend.generate import GenerateHandler
from dynamo.frontend.http_front import connection_factory
from dynamo.frontend.migration import MigrationPolicy
from dynamo.frontend.model_registry import ModelEntry, ModelRegistry
from dynamo.frontend.offload import Offload
from dynamo.frontend.pipeline import ModelPipeline
from dynamo.frontend.routes import Routes
from dynamo.observability.metrics import FrontendMetrics, RouterMetrics, WorkerLoadGauges
from dynamo.observability.router_metrics import RouterQueueGauges, RouterRequestMetrics
from dynamo.preprocess import Preprocessor, load_model_dir
from dynamo.protocol.model_card import ModelCard, WorkerRole
from dynamo.router.basic import RandomRouter, RoundRobinRouter, Router
from dynamo.router.config import KVRouterSettings
from dynamo.router.kv_router import KVRouter
from dynamo.router.queue import DEFAULT_POLICY_CLASS
from dynamo.runtime.http_limits import raise_fd_limit
from dynamo.runtime.http_server import HttpServer
from dynamo.runtime.naming import new_instance_id
from dynamo.runtime.published_files import fetch_files
from dynamo.runtime.runtime import DistributedRuntime, InProcessHub

log = logging.getLogger(__name__)
MAX_UNREAD_BYTES = 2 * 1024 * 1024
"""Response bytes a client may leave unread (beyond what its socket buffers hold) before the
write-behind thread drops its connection: a stream makes ~20 KB/s, so only a stalled client
gets there, and the frontend's memory stays bounded by connections x this."""


class FrontendService:
    """Owns the runtime (unless given one), the registry, the routes and the HTTP server."""

    def __init__(
        self,
        config: FrontendConfig,
        *,
        runtime: DistributedRuntime | None = None,
        hub: InProcessHub | None = None,
    ) -> None:
        self.config = config
        self._owns_runtime = runtime is None
        self.runtime = runtime or DistributedRuntime(config.runtime, hub)
        self.metrics = FrontendMetrics(config.metrics_prefix)
        self.router_metrics = RouterMetrics(self.metrics.registry, router_id=new_instance_id())
        WorkerLoadGauges(self.metrics.prefix, self.metrics.registry, self._worker_loads)
        self.router_requests = RouterRequestMetrics(
            self.metrics.registry, self.router_metrics.router_id
        )
        RouterQueueGauges(self.metrics.prefix, self.metrics.registry, self._queue_depths)
        self.migration = MigrationPolicy(
            config.migration_limit, config.migration_max_seq_len, self.metrics
        )
        self.disagg = Disaggregation(config.disagg, self.runtime, self.metrics)
        self.registry: ModelRegistry[ModelPipeline] = ModelRegistry(
            self.runtime,
            self._build_pipeline,
            router_factory=self._make_router,
            retention_s=config.model_retention_s,
            probe_interval_s=config.instance_probe_interval_s,
            on_change=self._on_model_change,
        )
        self.generate = GenerateHandler(
            self.registry,
            self.metrics,
            max_inflight=config.max_inflight,
            body_limit=config.body_limit_bytes,
            overload_status=config.overload_status,
            namespace=config.runtime.namespace,
            timeouts=Timeouts(config.first_response_timeout_s, config.inter_chunk_timeout_s),
            migration=self.migration,
            keep_alive_s=config.sse_keep_alive_s,
            admission=Admission(config.admission_factor),
            offload=Offload(
                config.preprocess_threads, config.preprocess_queue, tokenize_in=config.tokenize_in
            ),
        )
        self.dashboard = Dashboard(self.registry, self.metrics, self._worker_loads)
        self.generate.observers.append(self.dashboard.observe)
        self.routes = Routes(
            self.registry,
            self.metrics,
            self.generate,
            overload_status=config.overload_status,
            dashboard=self.dashboard,
        )
        self._server: HttpServer | None = None
        self.port = config.http_port

    async def _build_pipeline(self, card: ModelCard) -> ModelPipeline:
        # The files come from discovery (published by the worker), not from a path on the
        # worker's disk; cards without them (older workers) fall back to ``model_path``.
        path: str | Path = card.model_path
        if card.files_prefix is not None:
            cache = Path(tempfile.gettempdir()) / "dynamo-model-files"
            path = await fetch_files(
                self.runtime.discovery,
                card.files_prefix,
                cache / card.files_prefix.rstrip("/").rsplit("/", 1)[-1],
            )
        model_dir = await asyncio.to_thread(
            load_model_dir, path, context_length=card.context_length
        )
        preprocessor = Preprocessor(
            model_dir, served_model_name=card.served_model_name, context_length=card.context_length
        )
        return ModelPipeline(
            card.served_model_name, preprocessor, disagg=self.disagg, metrics=self.metrics
        )

    def _worker_loads(self) -> Iterator[tuple[int, int, str, int, int]]:
        """Each KV router's view of its workers' load (the ``worker_active_*`` gauges)."""
        for entry in self.registry.models():
            for role, router in list(entry.routers.items()):
                if not isinstance(router, KVRouter):
                    continue
                seqs = router.sequences
                for worker_id, dp_rank in seqs.ranks():
                    yield (
                        worker_id,
                        dp_rank,
                        role.value,
                        seqs.active_decode_blocks(worker_id, dp_rank),
                        seqs.active_prefill_tokens(worker_id, dp_rank),
                    )

    def _queue_depths(self) -> Iterator[tuple[str, str, int, int, int, int]]:
        """Each KV router's queue (the ``router_queue_*`` families)."""
        for entry in self.registry.models():
            for role, router in list(entry.routers.items()):
                queue = router.queue if isinstance(router, KVRouter) else None
                if queue is None:
                    continue
                pending = queue.pending
                yield (
                    role.value,
                    DEFAULT_POLICY_CLASS,
                    len(pending),
                    pending.isl_tokens,
                    pending.cached_tokens,
                    pending.rejected,
                )

    async def _make_router(self, card: ModelCard) -> Router:
        """A router for the workers of ``card``'s role (the registry closes it on retirement)."""
        mode = self.config.router_mode
        if mode == "random":
            return RandomRouter()
        if mode == "kv":
            settings = role_settings(self.config.kv, card.role)
            series = self.router_requests.bind(
                card.namespace,
                card.component,
                card.endpoint,
                card.role.value,
                card.served_model_name,
            )
            return await KVRouter.create(self.runtime, card, settings, self.router_metrics, series)
        return RoundRobinRouter()

    def _on_model_change(self, entry: ModelEntry[ModelPipeline], added: bool) -> None:
        m = self.metrics
        live = 1.0 if entry.cards else 0.0
        m.model_ready.labels(entry.name).set(live)
        if added and entry.cards:
            card = entry.any_card
            role = card.role.value
            ns = card.namespace
            m.model_context_length.labels(entry.name, ns, role).set(card.context_length)
            m.model_kv_cache_block_size.labels(entry.name, ns, role).set(card.kv_block_size)
            limit = self.migration.effective_limit(entry.migration_limit)
            m.model_migration_limit.labels(entry.name, ns, role).set(limit)
            total = sum(c.total_kv_blocks or 0 for c in entry.cards.values())
            m.model_total_kv_blocks.labels(entry.name, ns, role).set(total)
            if card.max_num_seqs is not None:
                m.model_max_num_seqs.labels(entry.name, ns, role).set(card.max_num_seqs)
            if card.max_num_batched_tokens is not None:
                m.model_max_num_batched_tokens.labels(entry.name, ns, role).set(
                    card.max_num_batched_tokens
                )

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        """Start the runtime, follow model cards, and listen for HTTP."""
        if self._owns_runtime:
            await self.runtime.start()
        await self.disagg.start()
        await self.registry.start()
        await self.dashboard.start(self.runtime)
        limits = self.config.limits
        # two descriptors a connection (the write-behind thread writes a dup of the socket)
        raise_fd_limit(2 * limits.max_connections + 1024)
        self._server = HttpServer(
            None,
            self.config.http_host,
            self.config.http_port,
            write_behind=True,
            max_backlog_bytes=MAX_UNREAD_BYTES,
            limits=limits,
            connection=connection_factory(self.routes, self.config.body_limit_bytes),
        )
        await self._server.start()
        self.port = self._server.port
        log.info("frontend listening on http://%s:%d", self.config.http_host, self.port)

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop taking requests, let in-flight ones finish (``grace_s``), cancel the rest, then
        close the registry and (if owned) the runtime."""
        self.routes.draining = True
        self.generate.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self.generate.inflight and loop.time() < deadline:
            await asyncio.sleep(0.02)
        self.generate.cancel_all()
        if self._server is not None:
            await self._server.stop()
            self._server = None
        await self.dashboard.close()
        self.generate.offload.close()
        await self.registry.close()  # closes the models' routers too
        await self.disagg.close()
        if self._owns_runtime:
            await self.runtime.shutdown()


def role_settings(settings: KVRouterSettings, role: WorkerRole) -> KVRouterSettings:
    """The KV router flags of one worker role (FACTS §4.6): a decode set's router gives no
    credit for cached blocks, assumes no reuse (its blocks arrive by transfer, not shared) and
    does not count prompt tokens (no prefill runs there); a prefill set's router tracks no active
    blocks (prefill workers keep nothing once the KV is handed off)."""
    if role is WorkerRole.DECODE:  # no prefill load to wait for: no router queue either
        return dataclasses.replace(
            settings,
            overlap_score_credit=0.0,
            assume_kv_reuse=False,
            track_prefill_tokens=False,
            queue_threshold=None,
        )
    if role is WorkerRole.PREFILL:
        return dataclasses.replace(settings, track_active_blocks=False)
    return settings
