"""``Worker``: runs one or more engines inside a ``DistributedRuntime`` (spec 000).

Lifecycle::

    start runtime -> engine.start(worker_id) -> serve the generate endpoint + register the model
    card -> ... serve until SIGTERM/SIGINT or request_shutdown() ...
    -> unregister (discovery first: routers stop sending) -> grace period (in-flight requests
    finish, bounded by graceful_shutdown_timeout) -> engine.drain() -> engine.cleanup() (once)
    -> runtime teardown

A signal during start-up still shuts down cleanly: ``start()`` is abandoned and ``cleanup()``
runs on the partial state.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
from prometheus_client import CollectorRegistry

from dynamo.backend.adapter import EngineAdapter
from dynamo.backend.disagg import role_component
from dynamo.backend.engine import EngineConfig, LLMEngine, RankMetrics
from dynamo.backend.health_check import HealthCanary, HealthCheckConfig, canary_payload
from dynamo.backend.prefill_queue import PrefillQueueConsumer
from dynamo.backend.status_server import StatusConfig, StatusServer
from dynamo.observability.engine_metrics import EngineGauges
from dynamo.observability.metrics import WorkerMetrics
from dynamo.protocol.model_card import ModelCard, WorkerRole
from dynamo.runtime.config import RuntimeConfig
from dynamo.runtime.naming import EndpointId, model_files_prefix, new_instance_id
from dynamo.runtime.published_files import publish_files
from dynamo.runtime.runtime import DistributedRuntime, ServedEndpoint

log = logging.getLogger(__name__)

_card_encoder = msgspec.json.Encoder()


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    model_path: str = ""
    served_model_name: str | None = None
    component: str | None = None
    endpoint: str = "generate"
    role: WorkerRole = WorkerRole.AGGREGATED
    graceful_shutdown_timeout: float = 5.0
    strict_validation: bool = False  # raise on stream-contract violations (debug validator)
    install_signal_handlers: bool = True
    system_host: str = "0.0.0.0"
    system_port: int | None = None  # DYN_SYSTEM_PORT: the status server (None: off, 0: any)
    status: StatusConfig = field(default_factory=StatusConfig)
    health_check: HealthCheckConfig = field(default_factory=HealthCheckConfig)
    migration_limit: int = 0  # advertised in the model card (request migration, frontend side)

    def endpoint_id(self) -> EndpointId:
        component = self.component or role_component(self.role)
        return EndpointId(self.runtime.namespace, component, self.endpoint)


@dataclass
class _Registration:
    engine: LLMEngine
    adapter: EngineAdapter
    worker_id: int
    engine_config: EngineConfig | None = None
    served: ServedEndpoint | None = None
    card_key: str | None = None
    cleaned: bool = False
    canary: HealthCanary | None = None
    consumer: PrefillQueueConsumer | None = None


class Worker:
    """Serves ``engines`` (usually one) under one runtime. Use :func:`dynamo.backend.run.run`."""

    def __init__(
        self,
        engines: Sequence[LLMEngine],
        config: WorkerConfig,
        *,
        runtime: DistributedRuntime | None = None,
        owns_runtime: bool | None = None,
    ) -> None:
        """``runtime``: share one (e.g. several workers in one process); the worker shuts it
        down only if it owns it (default: when it created it)."""
        if not engines:
            raise ValueError("a worker needs at least one engine")
        self.config = config
        self._owns_runtime = runtime is None if owns_runtime is None else owns_runtime
        self.runtime = runtime or DistributedRuntime(config.runtime)
        endpoint = config.endpoint_id()
        self.metrics_registry = CollectorRegistry(auto_describe=True)
        self.metrics = WorkerMetrics(
            endpoint.namespace, endpoint.component, endpoint.endpoint, self.metrics_registry
        )
        self._regs = [
            _Registration(
                e,
                EngineAdapter(
                    e,
                    strict=config.strict_validation,
                    metrics=self.metrics,
                    disagg_role=config.role.value,
                ),
                new_instance_id(),
            )
            for e in engines
        ]
        EngineGauges(
            self.metrics_registry,
            endpoint.namespace,
            endpoint.component,
            endpoint.endpoint,
            self._engine_metrics,
        )
        self.status: StatusServer | None = None
        self._starting_ready = config.status.starting_ready
        self._shutdown = asyncio.Event()
        self._cleanup_lock = asyncio.Lock()
        self._hooks: list[Callable[[Worker], Awaitable[None]]] = []
        self.ready = asyncio.Event()

    @property
    def worker_ids(self) -> list[int]:
        return [r.worker_id for r in self._regs]

    @property
    def engines(self) -> list[LLMEngine]:
        """The engines served, in ``worker_ids`` order."""
        return [r.engine for r in self._regs]

    def on_registered(self, hook: Callable[[Worker], Awaitable[None]]) -> None:
        """Run ``hook(worker)`` after the engines are registered (e.g. serve side endpoints)."""
        self._hooks.append(hook)

    def request_shutdown(self) -> None:
        """Begin a graceful shutdown (safe to call from a signal handler, more than once)."""
        self._shutdown.set()

    async def run(self) -> None:
        """Start, serve until shutdown is requested, then shut down in order."""
        loop = asyncio.get_running_loop()
        installed: list[signal.Signals] = []
        # Signal handlers can only be installed from the main thread (a worker run inside
        # another program's thread leaves signals to that program).
        if (
            self.config.install_signal_handlers
            and threading.current_thread() is threading.main_thread()
        ):
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_shutdown)
                installed.append(sig)
        try:
            await self._start_status_server()
            if await self._start_or_abandon():
                await self._register()
                self._start_canaries()
                for hook in self._hooks:
                    await hook(self)
                await self._start_prefill_consumers()
                self.ready.set()
                await self._shutdown.wait()
        finally:
            await self._teardown()
            for sig in installed:
                loop.remove_signal_handler(sig)

    async def _start_status_server(self) -> None:
        if self.config.system_port is None:
            return
        self.status = StatusServer(
            self._health,
            self.metrics_registry,
            self.metrics,
            self.config.system_host,
            self.config.system_port,
            self.config.status,
        )
        await self.status.start()
        log.info("status server listening on %s:%d", self.config.system_host, self.status.port)

    def _health(self) -> dict[str, bool]:
        if not self.ready.is_set() and not self._shutdown.is_set():  # still starting
            return {self.config.endpoint: self._starting_ready}
        serving = self.ready.is_set() and not self._shutdown.is_set()
        canaries_ok = all(r.canary is None or r.canary.healthy for r in self._regs)
        return {self.config.endpoint: serving and canaries_ok}

    async def _start_prefill_consumers(self) -> None:
        """A prefill worker's engines also pull their model's global prefill queue (frontends
        in dispatch ``queue`` push there; with none, the pulls find nothing)."""
        if self.config.role is not WorkerRole.PREFILL:
            return
        for reg in self._regs:
            assert reg.engine_config is not None
            model = self.config.served_model_name or reg.engine_config.name
            reg.consumer = PrefillQueueConsumer(self.runtime, reg.adapter, reg.worker_id, model)
            await reg.consumer.start()

    def _start_canaries(self) -> None:
        """One health-check canary per registered engine that has a payload (FACTS §8)."""
        hc = self.config.health_check
        if not hc.enabled:
            return
        for reg in self._regs:
            assert reg.engine_config is not None and reg.served is not None
            payload = canary_payload(reg.engine, hc, reg.engine_config.name)
            if payload is None:
                log.warning("engine %x has no health-check payload: not probed", reg.worker_id)
                continue
            reg.canary = HealthCanary(
                self.runtime, reg.served, payload, hc, _activity_of(reg.adapter)
            )
            reg.canary.start()

    def _engine_metrics(self) -> Iterator[tuple[str, int, Sequence[RankMetrics]]]:
        """Each started engine's gauges (an engine whose snapshot fails is left out)."""
        for reg in self._regs:
            ec = reg.engine_config
            if ec is None or reg.cleaned:
                continue
            try:
                snapshot = reg.engine.metrics_snapshot()
            except Exception:
                log.exception("metrics_snapshot() of engine %x failed", reg.worker_id)
                continue
            yield self.config.served_model_name or ec.name, reg.worker_id, snapshot

    async def _start_or_abandon(self) -> bool:
        """Start runtime and engines; False if shutdown was requested first."""
        starting = asyncio.ensure_future(self._start_all())
        stopping = asyncio.ensure_future(self._shutdown.wait())
        done, _ = await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if starting in done:
            stopping.cancel()
            starting.result()  # re-raise a start failure (teardown still runs)
            return not self._shutdown.is_set()
        log.info("shutdown requested during start-up; abandoning start")
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        return False

    async def _start_all(self) -> None:
        await self.runtime.start()
        self.runtime.on_lease_lost(self.request_shutdown)
        for reg in self._regs:
            reg.engine_config = await reg.engine.start(reg.worker_id)
            if not reg.engine_config.model:
                raise ValueError("engine.start() returned an EngineConfig with an empty model")

    async def _register(self) -> None:
        endpoint_id = self.config.endpoint_id()
        checksum = _tokenizer_checksum(self.config.model_path)
        files_prefix = await self._publish_pipeline_files(checksum)
        for reg in self._regs:
            assert reg.engine_config is not None
            reg.served = await self.runtime.serve_endpoint(
                endpoint_id, reg.adapter.handle, instance_id=reg.worker_id
            )
            card = self._model_card(endpoint_id, reg.worker_id, reg.engine_config, checksum)
            card.files_prefix = files_prefix
            reg.card_key = endpoint_id.model_card_key(reg.worker_id)
            await self.runtime.discovery.put(
                reg.card_key, _card_encoder.encode(card), self.runtime.lease
            )
            log.info(
                "serving model %r as %s instance %x",
                card.served_model_name,
                endpoint_id,
                reg.worker_id,
            )

    async def _publish_pipeline_files(self, checksum: str | None) -> str | None:
        """Publish the tokenizer/template/config files for frontends on other hosts."""
        if checksum is None:
            return None
        from dynamo.preprocess.model_dir import pipeline_files

        prefix = model_files_prefix(checksum)
        root = Path(self.config.model_path)
        await publish_files(self.runtime.discovery, prefix, root, pipeline_files(root))
        return prefix

    def _model_card(
        self, endpoint_id: EndpointId, worker_id: int, ec: EngineConfig, checksum: str | None
    ) -> ModelCard:
        return ModelCard(
            served_model_name=self.config.served_model_name or ec.name,
            model_path=self.config.model_path or ec.model,
            namespace=endpoint_id.namespace,
            component=endpoint_id.component,
            endpoint=endpoint_id.endpoint,
            instance_id=worker_id,
            context_length=ec.context_length,
            kv_block_size=ec.kv_block_size,
            total_kv_blocks=ec.total_kv_blocks,
            max_num_seqs=ec.max_num_seqs,
            max_num_batched_tokens=ec.max_num_batched_tokens,
            data_parallel_start_rank=ec.data_parallel_start_rank,
            data_parallel_size=ec.data_parallel_size,
            role=self.config.role,
            tokenizer_checksum=checksum,
            bootstrap_host=ec.bootstrap_host,
            bootstrap_port=ec.bootstrap_port,
            capabilities=ec.capabilities,
            migration_limit=self.config.migration_limit,
            kv_events=ec.kv_events,
        )

    async def _teardown(self) -> None:
        for reg in self._regs:
            if reg.canary is not None:
                await reg.canary.stop()
        # 1. Leave discovery: routers stop picking us; requests already sent still arrive.
        for reg in self._regs:
            await self._unregister(reg)
        log.info("worker left discovery; grace period %.1fs", self.config.graceful_shutdown_timeout)
        # A prefill worker pulls no more prefill tasks; the ones in hand may finish in the grace
        # period (what is left is given back to the queue when the runtime closes it).
        await asyncio.gather(
            *(
                r.consumer.stop(self.config.graceful_shutdown_timeout)
                for r in self._regs
                if r.consumer is not None
            )
        )
        # 2. Grace period: let in-flight requests finish.
        await self._wait_inflight(self.config.graceful_shutdown_timeout)
        # 3. Drain and clean up each engine exactly once.
        for reg in self._regs:
            await self._drain_and_cleanup(reg)
        # 4. Runtime teardown (cancels anything still in flight).
        if self._owns_runtime:
            await self.runtime.shutdown()
        if self.status is not None:
            await self.status.stop()
        log.info("worker stopped")

    async def _unregister(self, reg: _Registration) -> None:
        try:
            if reg.card_key is not None:
                await self.runtime.discovery.delete(reg.card_key)
                reg.card_key = None
            if reg.served is not None:
                await self.runtime.unserve(reg.served)
                reg.served = None
        except Exception:
            log.exception("unregistering worker %x failed", reg.worker_id)

    async def _wait_inflight(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while any(r.adapter.num_inflight for r in self._regs) and loop.time() < deadline:
            await asyncio.sleep(0.02)

    async def _drain_and_cleanup(self, reg: _Registration) -> None:
        # The lock + flag make cleanup run once even if teardown is entered twice.
        async with self._cleanup_lock:
            if reg.cleaned:
                return
            reg.cleaned = True
            if reg.engine_config is not None:
                try:
                    await reg.engine.drain()
                except Exception:
                    log.exception("engine.drain failed")
            await reg.adapter.wait_aborts()
            try:
                await reg.engine.cleanup()
            except Exception:
                log.exception("engine.cleanup failed")


def _activity_of(adapter: EngineAdapter) -> Callable[[], float]:
    return lambda: adapter.last_activity


def _tokenizer_checksum(model_path: str) -> str | None:
    """The same checksum the frontend computes for the model's pipeline (None: no tokenizer)."""
    if not model_path:
        return None
    from dynamo.preprocess.model_dir import tokenizer_checksum

    try:
        return tokenizer_checksum(model_path)
    except (OSError, ValueError):
        return None
