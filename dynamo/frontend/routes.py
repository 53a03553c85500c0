"""Route handlers: the OpenAI endpoints, model listings, health and metrics.

Handlers talk to the HTTP server through :class:`~dynamo.frontend.exchange.Exchange`
(implemented by ``http_exchange.py`` for the frontend's HTTP connections, faked in tests), so
they stay server-independent and testable.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import generate_latest

from dynamo.frontend.dashboard import Dashboard
from dynamo.frontend.dashboard_page import PAGE
from dynamo.frontend.errors import HTTPError, to_http
from dynamo.frontend.exchange import Exchange
from dynamo.frontend.generate import GenerateHandler
from dynamo.frontend.model_registry import ModelRegistry
from dynamo.frontend.pipeline import ModelPipeline
from dynamo.frontend.streaming import JSON_HEADERS, encode_json
from dynamo.observability.metrics import FrontendMetrics
from dynamo.protocol.openai import ModelList, ModelListing
from dynamo.router.kv_router import KVRouter


class Routes:
    """Dispatches by path and method; every failure becomes an OpenAI error body."""

    def __init__(
        self,
        registry: ModelRegistry[ModelPipeline],
        metrics: FrontendMetrics,
        generate: GenerateHandler,
        *,
        overload_status: int,
        dashboard: Dashboard | None = None,
    ) -> None:
        self._registry = registry
        self._dashboard = dashboard
        self._metrics = metrics
        self._generate = generate
        self._overload_status = overload_status
        self.draining = False
        self._get = {
            "/v1/models": self._models,
            "/dynamo/alpha/list-models": self._list_models_extended,
            "/metrics": self._metrics_text,
            "/health": self._health,
            "/live": self._live,
        }
        if dashboard is not None:
            self._get["/dashboard"] = self._dashboard_page
            self._get["/dashboard/data"] = self._dashboard_data
        self._post = {
            "/v1/chat/completions": self._generate.chat,
            "/v1/completions": self._generate.completion,
        }

    async def __call__(self, http: Exchange) -> None:
        try:
            await self._dispatch(http)
        except Exception as exc:  # never a traceback on the wire
            reply = to_http(exc, self._overload_status)
            http.reply(reply.status, [*JSON_HEADERS, *reply.headers], reply.body)

    async def _dispatch(self, http: Exchange) -> None:
        path = http.path.rstrip("/") or "/"
        if http.method == "POST" and path in self._post:
            await self._post[path](http)
            return
        if http.method in ("GET", "HEAD"):
            handler = self._get.get(path)
            if handler is not None:
                handler(http)
                return
            if path.startswith("/v1/models/"):
                self._model(http, path.removeprefix("/v1/models/"))
                return
        allowed = self._allowed_methods(path)
        if allowed:
            reply = to_http(HTTPError(405, f"method {http.method} not allowed on {path}"))
            http.reply(405, [*JSON_HEADERS, ("allow", ", ".join(allowed))], reply.body)
            return
        raise HTTPError(404, f"no route for {http.method} {path}")

    def _allowed_methods(self, path: str) -> list[str]:
        if path in self._post:
            return ["POST"]
        if path in self._get or path.startswith("/v1/models/"):
            return ["GET", "HEAD"]
        return []

    # -- GET handlers --------------------------------------------------------------------
    def _listing(self) -> list[ModelListing]:
        return [ModelListing(id=e.name, created=e.created) for e in self._registry.models()]

    def _models(self, http: Exchange) -> None:
        http.reply(200, JSON_HEADERS, encode_json(ModelList(data=self._listing())))

    def _model(self, http: Exchange, model_id: str) -> None:
        for listing in self._listing():
            if listing.id == model_id:
                http.reply(200, JSON_HEADERS, encode_json(listing))
                return
        raise HTTPError(404, f"The model `{model_id}` does not exist", param="model")

    def _list_models_extended(self, http: Exchange) -> None:
        models: list[dict[str, Any]] = []
        for entry in self._registry.models():
            card = entry.any_card
            models.append(
                {
                    "name": entry.name,
                    "model_path": card.model_path,
                    "context_length": card.context_length,
                    "kv_cache_block_size": card.kv_block_size,
                    "instances": sorted(entry.cards),
                    "live_instances": entry.live_instance_ids(entry.serving_role()),
                    "roles": sorted({c.role.value for c in entry.cards.values()}),
                }
            )
        names = [m["name"] for m in models]
        body = {"chat_completion_models": names, "completion_models": names, "models": models}
        http.reply(200, JSON_HEADERS, encode_json(body))

    def _metrics_text(self, http: Exchange) -> None:
        http.reply(
            200,
            [("content-type", "text/plain; version=0.0.4; charset=utf-8")],
            generate_latest(self._metrics.registry),
        )

    def _health(self, http: Exchange) -> None:
        instances: list[dict[str, Any]] = []
        endpoints: set[str] = set()
        for entry in self._registry.models():
            for iid in entry.live_instance_ids(entry.serving_role()):
                card = entry.cards[iid]
                endpoints.add(f"dyn://{card.namespace}.{card.component}.{card.endpoint}")
                instances.append(
                    {
                        "namespace": card.namespace,
                        "component": card.component,
                        "endpoint": card.endpoint,
                        "instance_id": iid,
                        "model": entry.name,
                    }
                )
        ready = bool(instances) and not self.draining
        body = {
            "status": "healthy" if ready else "not_ready",
            "endpoints": sorted(endpoints),
            "instances": instances,
            "kv_consistency": self._kv_consistency(),
        }
        http.reply(200 if ready else 503, JSON_HEADERS, encode_json(body))

    def _dashboard_page(self, http: Exchange) -> None:
        http.reply(200, [("content-type", "text/html; charset=utf-8")], PAGE)

    def _dashboard_data(self, http: Exchange) -> None:
        assert self._dashboard is not None
        headers = [*JSON_HEADERS, ("cache-control", "no-store")]
        http.reply(200, headers, encode_json(self._dashboard.snapshot()))

    def _kv_consistency(self) -> list[dict[str, object]]:
        """Each KV router's latest cache-consistency check, per worker rank."""
        out: list[dict[str, object]] = []
        for entry in self._registry.models():
            for role, router in list(entry.routers.items()):
                if isinstance(router, KVRouter):
                    for state in router.consistency.values():
                        out.append({"model": entry.name, "role": role.value, **state.as_json()})
        return out

    def _live(self, http: Exchange) -> None:
        if self.draining:
            body = {"status": "shutting_down", "message": "Service is shutting down"}
            http.reply(503, JSON_HEADERS, encode_json(body))
            return
        http.reply(200, JSON_HEADERS, encode_json({"status": "live", "message": "Service is live"}))
