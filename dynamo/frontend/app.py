"""The frontend service: HTTP server (granian, RSGI interface) + runtime + model registry.

granian was chosen by measurement (docs/performance.md): its RSGI interface has the least Python
per request. The embedded server runs in this process's event loop, next to the discovery
watches, so handlers share state with them without locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
import tempfile
from collections import Counter
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any

from granian._granian import ListenerSpec, RSGIProtocolClosed, RSGIProtocolError
from granian.http import HTTP1Settings
from granian.server.embed import Server

from dynamo.frontend.admission import Admission
from dynamo.frontend.attempt import Timeouts
from dynamo.frontend.config import FrontendConfig
from dynamo.frontend.dashboard import Dashboard
from dynamo.frontend.disagg import Disaggregation
from dynamo.frontend.errors import HTTPError
from dynamo.frontend.exchange import ClientDisconnected, StreamSink
from dynamo.frontend.generate import GenerateHandler
from dynamo.frontend.idle import TaskDeadline
from dynamo.frontend.idle_reaper import IdleReaper, Peer, parse_peer
from dynamo.frontend.migration import MigrationPolicy
from dynamo.frontend.model_registry import ModelEntry, ModelRegistry
from dynamo.frontend.offload import Offload
from dynamo.frontend.overflow import OverflowRefuser
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
from dynamo.runtime.naming import new_instance_id
from dynamo.runtime.published_files import fetch_files
from dynamo.runtime.runtime import DistributedRuntime, InProcessHub

log = logging.getLogger(__name__)
_DRAIN_MAX_BYTES = 64 * 1024 * 1024
"""A body declared over the limit but under this is read and dropped before the 413 ..."""
_DRAIN_GRACE_S = 2.0
"""... for at most this long."""


class _Server(Server):
    """granian's embedded server, binding its listener itself so that port 0 works and the
    bound port can be read (``bound_port``). Relies on a private hook: granian is pinned."""

    bound_port: int = 0
    listen_fd: int = -1

    def _init_shared_socket(self) -> None:
        holder = ListenerSpec(self.bind_addr, self.bind_port, self.backlog).build()
        fd = holder.get_fd()
        self.listen_fd = fd
        self._shd = holder  # type: ignore[assignment]
        self._sfd = fd  # type: ignore[assignment]
        self._ssp = None
        with socket.socket(fileno=os.dup(fd)) as sock:
            self.bound_port = sock.getsockname()[1]


class _RSGIStream:
    __slots__ = ("_transport",)

    def __init__(self, transport: Any) -> None:
        self._transport = transport

    async def send(self, data: bytes) -> None:
        if self._transport is None:
            raise ConnectionError("the response stream has ended")
        try:
            await self._transport.send_bytes(data)
        except (RSGIProtocolClosed, RSGIProtocolError) as exc:
            raise ClientDisconnected("the client closed the connection") from exc


class _RSGIExchange:
    """Adapts one granian RSGI request to the handlers' :class:`Exchange`."""

    __slots__ = ("method", "path", "_scope", "_protocol", "_stream", "_body_timeout_s")

    def __init__(self, scope: Any, protocol: Any, body_timeout_s: float = 30.0) -> None:
        self.method: str = scope.method
        self.path: str = scope.path
        self._scope = scope
        self._protocol = protocol
        self._stream: _RSGIStream | None = None
        self._body_timeout_s = body_timeout_s

    def release(self) -> None:
        """Drop our references to granian's transport: granian ends a streamed response when its
        transport is freed, and a traceback cycle (an error after streaming began) would
        otherwise keep it, and the client's connection, open until the next GC run."""
        if self._stream is not None:
            self._stream._transport = None
            self._stream = None
        self._protocol = None

    def header(self, name: str) -> str | None:
        value = self._scope.headers.get(name)
        return value if value else None

    async def body(self, limit: int) -> bytes:
        declared = self.header("content-length")
        too_large = declared is not None and declared.isdigit() and int(declared) > limit
        if too_large and int(declared or 0) > _DRAIN_MAX_BYTES:
            raise HTTPError(413, f"request body exceeds the {limit}-byte limit")
        if too_large:
            # Read and drop what arrives within a short grace, piece by piece (never one large
            # copy): a client that sends its whole body before it reads then gets the 413, not
            # a reset; one that waits for the answer gets it after the grace.
            with contextlib.suppress(TimeoutError, RSGIProtocolClosed, RSGIProtocolError):
                async with asyncio.timeout(min(self._body_timeout_s, _DRAIN_GRACE_S)):
                    async for _ in self._protocol:
                        pass
            raise HTTPError(413, f"request body exceeds the {limit}-byte limit")
        try:
            with TaskDeadline(self._body_timeout_s):
                return await self._read_body(declared, limit)
        except TimeoutError:
            raise HTTPError(408, "the request body was not received in time") from None
        except (RSGIProtocolClosed, RSGIProtocolError) as exc:
            raise ClientDisconnected("the client went away while sending its body") from exc

    async def _read_body(self, declared: str | None, limit: int) -> bytes:
        if declared is not None and declared.isdigit():
            data: bytes = await self._protocol()  # the server enforces the declared length
            if len(data) != int(declared):  # granian hands over what came before a half-close
                raise ClientDisconnected("the client went away while sending its body")
            return data
        # chunked (no length declared): read piece by piece, so that an oversized body is
        # refused once it passes the limit instead of being buffered whole first
        parts: list[bytes] = []
        size = 0
        async for part in self._protocol:
            size += len(part)
            if size > limit:
                raise HTTPError(413, f"request body exceeds the {limit}-byte limit")
            parts.append(part)
        return b"".join(parts)

    def reply(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        self._protocol.response_bytes(status, headers, body)

    def start_stream(self, status: int, headers: list[tuple[str, str]]) -> StreamSink:
        self._stream = _RSGIStream(self._protocol.response_stream(status, headers))
        return self._stream

    def disconnected(self) -> Awaitable[None]:
        result: Awaitable[None] = self._protocol.client_disconnect()
        return result


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
            offload=Offload(config.preprocess_threads, config.preprocess_queue),
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
        self._server: _Server | None = None
        self._serve_task: asyncio.Task[None] | None = None
        self._reaper_task: asyncio.Task[None] | None = None
        self._overflow: OverflowRefuser | None = None
        # peers with a request in the handler: the idle reaper leaves their connections alone
        self._active_peers: Counter[Peer] = Counter()
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

    # -- RSGI entry point ---------------------------------------------------------------
    async def __call__(self, scope: Any, protocol: Any) -> None:
        if scope.proto != "http":
            return
        http = _RSGIExchange(scope, protocol, self.config.limits.body_timeout_s)
        peer = parse_peer(scope.client)
        peers = self._active_peers
        if peer is not None:
            peers[peer] += 1
        try:
            await self.routes(http)
        finally:
            http.release()
            if peer is not None:
                peers[peer] -= 1
                if not peers[peer]:
                    del peers[peer]

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        """Start the runtime, follow model cards, and listen for HTTP."""
        if self._owns_runtime:
            await self.runtime.start()
        await self.disagg.start()
        await self.registry.start()
        await self.dashboard.start(self.runtime)
        limits = self.config.limits
        # granian serves at most ``backpressure`` connections; more wait in the listen backlog,
        # where the overflow refuser answers them 503 (granian cannot).
        # Its header read timeout also closes idle keep-alive connections (hyper arms it while
        # waiting for the next request's head), so idle sockets cannot hold those places.
        raise_fd_limit(limits.max_connections + 1024)
        self._server = _Server(
            self,
            address=self.config.http_host,
            port=self.config.http_port,
            log_enabled=False,
            backlog=1024,
            backpressure=limits.max_connections,
            http1_settings=HTTP1Settings(
                header_read_timeout=int(
                    min(limits.header_timeout_s, limits.keep_alive_timeout_s) * 1000
                ),
                max_buffer_size=max(limits.max_header_bytes, 8192),
            ),
        )
        self._serve_task = asyncio.create_task(self._server.serve(), name="frontend-http")
        await self._wait_listening()
        if IdleReaper.supported():
            reaper = IdleReaper(self.port, limits.header_timeout_s, self._active_peers.keys)
            self._reaper_task = asyncio.create_task(reaper.run(), name="frontend-idle-reaper")
        if OverflowRefuser.supported():
            assert self._server is not None
            self._overflow = OverflowRefuser(
                self._server.listen_fd, self.port, limits.max_connections
            )
            self._overflow.start()
        log.info("frontend listening on http://%s:%d", self.config.http_host, self.port)

    async def _wait_listening(self, timeout: float = 10.0) -> None:
        host = "127.0.0.1" if self.config.http_host in ("0.0.0.0", "") else self.config.http_host
        assert self._server is not None
        async with asyncio.timeout(timeout):
            while True:
                if self._serve_task is not None and self._serve_task.done():
                    self._serve_task.result()
                    raise RuntimeError("HTTP server exited during start-up")
                self.port = self._server.bound_port
                if not self.port:
                    await asyncio.sleep(0.01)
                    continue
                try:
                    _, writer = await asyncio.open_connection(host, self.port)
                except OSError:
                    await asyncio.sleep(0.02)
                    continue
                writer.close()
                await writer.wait_closed()
                return

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
        if self._overflow is not None:
            await self._overflow.close()
            self._overflow = None
        if self._reaper_task is not None:
            self._reaper_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper_task
            self._reaper_task = None
        if self._server is not None:
            self._server.workers_kill_timeout = 3
            self._server.stop()  # type: ignore[no-untyped-call]
        if self._serve_task is not None:
            try:
                await self._serve_task
            except (TimeoutError, asyncio.CancelledError):
                log.warning("HTTP server did not stop in time; killed it")
            self._serve_task = None
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
