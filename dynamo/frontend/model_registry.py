"""The model registry: which models exist, built from the model cards workers put in discovery.

A model appears when its first worker's card appears and leaves the listing when its last card
goes. For ``retention_s`` afterwards a request for it gets 503 (temporarily unavailable: a rolling
restart) rather than 404.

Per model: one pipeline (``pipeline_factory``), built from the first card of a *serving* worker
(aggregated or decode: a prefill worker's card never defines how the model is decoded), and one
router per worker role (``router_factory``), created when the first worker of that role appears.
Every worker that joins or leaves is passed to its role's router from this watch, so a router
knows a worker (and indexes its KV events) from the moment its card is seen, not from the first
request routed to it. When the model retires its routers are closed. A worker whose tokenizer
checksum disagrees with the model's is refused with a logged reason.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Generic, TypeVar

import msgspec

from dynamo.frontend.capabilities import serving_capabilities
from dynamo.frontend.placement import InstanceStreams
from dynamo.protocol.model_card import EngineCapabilities, ModelCard, WorkerRole
from dynamo.router.basic import RoundRobinRouter, Router
from dynamo.runtime.client import EndpointClient
from dynamo.runtime.discovery.follower import PrefixFollower
from dynamo.runtime.errors import ModelNotFound, NoInstances
from dynamo.runtime.naming import EndpointId, model_cards_prefix
from dynamo.runtime.runtime import DistributedRuntime

log = logging.getLogger(__name__)

P = TypeVar("P")
_card_decoder = msgspec.json.Decoder(ModelCard)

RouterFactory = Callable[[ModelCard], Awaitable[Router]]


async def _round_robin(card: ModelCard) -> Router:
    return RoundRobinRouter()


@dataclass(frozen=True, slots=True)
class ServingView:
    """What a model's cards say about serving it, computed once per card change (see
    :meth:`ModelEntry.serving`): the serving role, its cards (read-only), the smallest migration
    limit they advertise and what every one of them honours."""

    role: WorkerRole
    cards: Sequence[ModelCard]
    migration_limit: int
    capabilities: EngineCapabilities | None


@dataclass
class ModelEntry(Generic[P]):
    """One model: its cards (one per worker instance), pipeline, routers and endpoint clients
    (one of each per worker role). ``pipeline`` is None while only prefill workers are known."""

    name: str
    checksum: str | None
    pipeline: P | None = None
    cards: Mapping[int, ModelCard] = field(default_factory=dict)
    """Read-only (a view): :meth:`put_card` and :meth:`drop_card` change it, so that the
    serving view derived from it (role, cards, migration limit) is computed once per change,
    not several times per request."""
    clients: dict[WorkerRole, EndpointClient] = field(default_factory=dict)
    routers: dict[WorkerRole, Router] = field(default_factory=dict)
    created: int = field(default_factory=lambda: int(time.time()))
    streams: InstanceStreams = field(default_factory=InstanceStreams)
    """This frontend's streams per serving instance (continuations are placed by them)."""

    _cards: dict[int, ModelCard] = field(init=False, repr=False)
    _serving: ServingView | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self._cards = dict(self.cards)
        self.cards = MappingProxyType(self._cards)

    def put_card(self, card: ModelCard) -> None:
        """Add (or replace) the card of ``card.instance_id``."""
        self._cards[card.instance_id] = card
        self._serving = None

    def drop_card(self, instance_id: int) -> ModelCard | None:
        """Remove the card of ``instance_id``; returns it (None if there was none)."""
        self._serving = None
        return self._cards.pop(instance_id, None)

    def serving(self) -> ServingView:
        """The serving view of the current cards (cached until a card changes)."""
        view = self._serving
        if view is None:
            cards = self._cards.values()
            role = (
                WorkerRole.DECODE
                if any(c.role is WorkerRole.DECODE for c in cards)
                else WorkerRole.AGGREGATED
            )
            serving = [c for c in cards if c.role is role]
            limit = min(c.migration_limit for c in serving) if serving else 0
            caps = serving_capabilities(serving)
            view = self._serving = ServingView(role, tuple(serving), limit, caps)
        return view

    def cards_of(self, role: WorkerRole) -> list[ModelCard]:
        return [c for c in self._cards.values() if c.role is role]

    def live_instance_ids(self, role: WorkerRole = WorkerRole.AGGREGATED) -> list[int]:
        """Instances of ``role`` that have a card *and* a live endpoint registration."""
        client = self.clients.get(role)
        if client is None:
            return []
        live = client.instance_ids()
        cards = self._cards
        return [i for i in live if i in cards and cards[i].role is role]

    def serving_role(self) -> WorkerRole:
        """Decode workers serve a disaggregated model; aggregated workers otherwise."""
        return self.serving().role

    def report_down(self, instance_id: int) -> None:
        """Instant failover: ``instance_id`` failed a stream; take it out of routing at once
        (its endpoint client stops listing it until a probe succeeds, and the router of its
        role forgets its load and index; the router re-learns it when it is a candidate
        again)."""
        card = self.cards.get(instance_id)
        if card is None:
            return
        client = self.clients.get(card.role)
        if client is not None and client.report_down(instance_id):
            router = self.routers.get(card.role)
            if router is not None:
                router.remove_worker(instance_id)

    @property
    def migration_limit(self) -> int:
        """What the model's serving workers advertise: the smallest of their limits (a request
        may be migrated only as often as every worker it can land on agrees to)."""
        return self.serving().migration_limit

    @property
    def router(self) -> Router:
        """The router of the serving role (NoInstances when it has no worker)."""
        router = self.routers.get(self.serving().role)
        if router is None:
            raise NoInstances(f"Model temporarily unavailable: {self.name!r} has no live instance")
        return router

    @property
    def any_card(self) -> ModelCard:
        return next(iter(self.cards.values()))


class ModelRegistry(Generic[P]):
    """Follows ``v1/mdc/{namespace}/`` in discovery. Owned by the frontend's composition root."""

    def __init__(
        self,
        runtime: DistributedRuntime,
        pipeline_factory: Callable[[ModelCard], Awaitable[P]],
        *,
        router_factory: RouterFactory = _round_robin,
        retention_s: float = 60.0,
        probe_interval_s: float = 1.0,
        on_change: Callable[[ModelEntry[P], bool], None] | None = None,
    ) -> None:
        self._runtime = runtime
        self._probe_interval_s = probe_interval_s
        self._factory = pipeline_factory
        self._router_factory = router_factory
        self._retention_s = retention_s
        self._on_change = on_change
        self._models: dict[str, ModelEntry[P]] = {}
        self._retired: dict[str, float] = {}
        self._keys: dict[str, tuple[str, int]] = {}
        self._clients: dict[EndpointId, EndpointClient] = {}
        self._follower: PrefixFollower | None = None
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        self._follower = PrefixFollower(
            self._runtime.discovery,
            model_cards_prefix(self._runtime.namespace),
            self._put,
            self._delete,
            name="model-registry-watch",
        )
        await self._follower.start()

    async def close(self) -> None:
        if self._follower is not None:
            await self._follower.close()
            self._follower = None
        for entry in list(self._models.values()):
            await self._close_routers(entry)
        self._models.clear()
        for client in self._clients.values():
            await client.close()
        self._clients.clear()

    async def _put(self, key: str, value: bytes) -> None:
        try:
            card = _card_decoder.decode(value)
        except msgspec.DecodeError:
            log.warning("ignoring malformed model card at %s", key)
            return
        async with self._lock:
            entry = self._models.get(card.served_model_name)
            if entry is None:
                entry = ModelEntry(card.served_model_name, card.tokenizer_checksum)
            elif entry.checksum != card.tokenizer_checksum:
                log.error(
                    "refusing worker %x for model %r: its tokenizer (checksum %s) differs from the "
                    "model's pipeline (checksum %s)",
                    card.instance_id,
                    entry.name,
                    card.tokenizer_checksum,
                    entry.checksum,
                )
                return
            if entry.pipeline is None and card.role is not WorkerRole.PREFILL:
                try:
                    entry.pipeline = await self._factory(card)
                except Exception as exc:
                    log.error(
                        "refusing worker %x: cannot load model %r from %s: %s",
                        card.instance_id,
                        card.served_model_name,
                        card.model_path,
                        exc,
                    )
                    return
            if card.role not in entry.routers:
                try:
                    entry.routers[card.role] = await self._router_factory(card)
                except Exception as exc:
                    log.error("refusing worker %x: no router for it: %s", card.instance_id, exc)
                    return
            if card.role not in entry.clients:
                entry.clients[card.role] = await self._client_for(
                    EndpointId(card.namespace, card.component, card.endpoint)
                )
            if entry.name not in self._models:
                self._models[entry.name] = entry
                self._retired.pop(entry.name, None)
                log.info("model %r is now served", entry.name)
            entry.put_card(card)
            entry.routers[card.role].add_worker(card)
            self._keys[key] = (entry.name, card.instance_id)
        if self._on_change is not None:
            self._on_change(entry, True)

    async def _delete(self, key: str) -> None:
        async with self._lock:
            located = self._keys.pop(key, None)
            if located is None:
                return
            name, instance_id = located
            entry = self._models.get(name)
            if entry is None:
                return
            card = entry.drop_card(instance_id)
            if card is not None:
                router = entry.routers.get(card.role)
                if router is not None:
                    router.remove_worker(instance_id)
            if not entry.cards:
                del self._models[name]
                self._retired[name] = time.monotonic() + self._retention_s
                await self._close_routers(entry)
                log.info("model %r has no workers left", name)
        if self._on_change is not None:
            self._on_change(entry, False)

    async def _close_routers(self, entry: ModelEntry[P]) -> None:
        routers = list(entry.routers.values())
        entry.routers.clear()
        for router in routers:
            try:
                await router.close()
            except Exception:
                log.exception("closing a router of model %r failed", entry.name)

    async def _client_for(self, endpoint_id: EndpointId) -> EndpointClient:
        client = self._clients.get(endpoint_id)
        if client is None:
            client = EndpointClient(
                endpoint_id,
                self._runtime.discovery,
                self._runtime.transport,
                probe_interval=self._probe_interval_s,
            )
            await client.start()
            self._clients[endpoint_id] = client
        return client

    # -- queries ---------------------------------------------------------------------------
    def get(self, name: str) -> ModelEntry[P]:
        """A servable model, or ModelNotFound (404) / NoInstances (503: recently gone, or only
        prefill workers so far)."""
        entry = self._models.get(name)
        if entry is not None:
            if entry.pipeline is None:
                raise NoInstances(f"Model temporarily unavailable: {name!r} has no decode worker")
            return entry
        until = self._retired.get(name)
        if until is not None and time.monotonic() < until:
            raise NoInstances(f"Model temporarily unavailable: {name!r} has no live instance")
        raise ModelNotFound(f"The model `{name}` does not exist")

    def models(self) -> list[ModelEntry[P]]:
        """The models that can be served (listed in /v1/models)."""
        return sorted(
            (e for e in self._models.values() if e.pipeline is not None), key=lambda e: e.name
        )

    def live_routers(self) -> list[Router]:
        """Every router of every model (for tests and diagnostics)."""
        return [r for e in self._models.values() for r in e.routers.values()]
