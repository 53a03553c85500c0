"""The live dashboard's data: ``GET /dashboard/data`` (JSON), rendered by ``GET /dashboard``
(``dashboard_page.py``, one self-contained page polling it every second).

What it shows and where each number comes from:

* models, their workers per role and readiness: the model registry (discovery);
* per worker: KV occupancy, running/waiting requests (the ``kv_metrics`` load messages workers
  publish on the event plane), the router's active decode blocks (the KV router's
  ``ActiveSequences``, the ``worker_active_decode_blocks`` gauge) and the prefix hit rate the
  frontend observed (cached prompt tokens / prompt tokens of the last 1,000 requests the worker
  served, from their usage);
* per model: requests (``requests_total``), the request rate over the last 10 s and TTFT / ITL
  percentiles estimated from the frontend's own histograms the way Prometheus'
  ``histogram_quantile`` does (so they agree with ``/metrics``);
* the last routing decisions (worker, DP rank, overlap blocks, cost, outcome).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from dynamo.frontend.inflight import InflightRequest
from dynamo.frontend.model_registry import ModelRegistry
from dynamo.frontend.pipeline import ModelPipeline
from dynamo.observability.engine_metrics import HitRateWindow
from dynamo.observability.metrics import FrontendMetrics
from dynamo.protocol.load import LOAD_TOPIC, WorkerLoad
from dynamo.runtime.runtime import DistributedRuntime

log = logging.getLogger(__name__)

RATE_WINDOW_S = 10.0
QUANTILES = (0.5, 0.9, 0.99)
_load_decoder = msgspec.msgpack.Decoder(WorkerLoad)


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """Prometheus' ``histogram_quantile``: ``buckets`` are (upper bound, cumulative count),
    sorted, ending with ``+Inf``. None when empty; linear within the bucket; the highest
    finite bound when the rank falls in ``+Inf``."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return prev_bound
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return prev_bound


def histogram_buckets(families: Iterable[Any], name: str, model: str) -> list[tuple[float, float]]:
    """The cumulative buckets of histogram ``name`` (full family name) for ``model``."""
    out: list[tuple[float, float]] = []
    for family in families:
        if family.name != name:
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket") and sample.labels.get("model") == model:
                out.append((float(sample.labels["le"]), sample.value))
    out.sort()
    return out


@dataclass(frozen=True, slots=True)
class Decision:
    at: float
    request_id: str
    model: str
    worker_id: str
    dp_rank: int | None
    overlap_blocks: int
    cost: float | None
    outcome: str


class Dashboard:
    """The dashboard's state. ``observe`` is called once per finished request (the generate
    handler's observer); ``start``/``close`` follow the workers' load messages."""

    def __init__(
        self,
        registry: ModelRegistry[ModelPipeline],
        metrics: FrontendMetrics,
        worker_loads: Callable[[], Iterable[tuple[int, int, str, int, int]]],
        *,
        decisions: int = 20,
    ) -> None:
        self._registry = registry
        self._metrics = metrics
        self._router_loads = worker_loads
        self.decisions: deque[Decision] = deque(maxlen=decisions)
        self._finished: dict[str, deque[float]] = {}
        self._hit_rates: dict[int, HitRateWindow] = {}
        self._served: dict[int, int] = {}
        self.loads: dict[tuple[int, int], WorkerLoad] = {}
        self._task: asyncio.Task[None] | None = None

    # -- inputs ------------------------------------------------------------------------------
    async def start(self, runtime: DistributedRuntime) -> None:
        sub = await runtime.events.subscribe(LOAD_TOPIC)
        self._task = asyncio.create_task(self._follow(sub), name="dashboard-loads")

    async def _follow(self, sub: Any) -> None:
        async for message in sub:
            try:
                load = _load_decoder.decode(message.payload)
            except msgspec.DecodeError:
                log.debug("ignoring a malformed load message")
                continue
            self.loads[(load.worker_id, load.dp_rank)] = load

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def observe(self, request: InflightRequest) -> None:
        """A request finished: its routing decisions, its worker's hit rate, the rate."""
        now = time.time()
        times = self._finished.setdefault(request.model, deque(maxlen=100_000))
        times.append(time.monotonic())
        stats = request.stats
        if stats is None:
            return
        outcome = request.status or "error"
        for choice in stats.choices:
            sel = choice.selection
            if sel is None:
                continue
            self.decisions.append(
                Decision(
                    now,
                    request.request_id,
                    request.model,
                    f"{sel.instance_id:x}",
                    sel.dp_rank,
                    sel.overlap_blocks,
                    sel.cost,
                    outcome,
                )
            )
            self._served[sel.instance_id] = self._served.get(sel.instance_id, 0) + 1
            prompt = choice.prompt_tokens or stats.prompt_tokens
            if choice.cached_tokens is not None and prompt:
                window = self._hit_rates.setdefault(sel.instance_id, HitRateWindow())
                window.observe(prompt, min(choice.cached_tokens, prompt))

    # -- output ------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        families = list(self._metrics.registry.collect())
        p = self._metrics.prefix
        requests = _requests_by_model(families, f"{p}_requests")
        now = time.monotonic()
        router_view = {(w, r): (t, blocks) for w, r, t, blocks, _ in self._router_loads()}
        models: list[dict[str, Any]] = []
        workers: list[dict[str, Any]] = []
        for entry in self._registry.models():
            roles: dict[str, list[str]] = {}
            for iid, card in sorted(entry.cards.items()):
                roles.setdefault(card.role.value, []).append(f"{iid:x}")
                ranks = sorted({r for (w, r) in (*self.loads, *router_view) if w == iid} or {0})
                for rank in ranks:
                    workers.append(
                        self._worker(entry.name, card.role.value, iid, rank, router_view)
                    )
            finished = self._finished.get(entry.name, deque())
            recent = sum(1 for t in finished if now - t <= RATE_WINDOW_S)
            models.append(
                {
                    "name": entry.name,
                    "ready": bool(entry.live_instance_ids(entry.serving_role())),
                    "roles": roles,
                    "requests_total": requests.get(entry.name, 0.0),
                    "request_rate": recent / RATE_WINDOW_S,
                    "ttft_s": self._quantiles(
                        families, f"{p}_time_to_first_token_seconds", entry.name
                    ),
                    "itl_s": self._quantiles(
                        families, f"{p}_inter_token_latency_seconds", entry.name
                    ),
                }
            )
        return {
            "time": time.time(),
            "models": models,
            "workers": workers,
            "requests_total": sum(requests.values()),
            "decisions": [_decision_json(d) for d in reversed(self.decisions)],
        }

    def _worker(
        self,
        model: str,
        role: str,
        iid: int,
        rank: int,
        router_view: dict[tuple[int, int], tuple[str, int]],
    ) -> dict[str, Any]:
        load = self.loads.get((iid, rank))
        window = self._hit_rates.get(iid)
        view = router_view.get((iid, rank))
        return {
            "model": model,
            "role": role,
            "worker_id": f"{iid:x}",
            "dp_rank": rank,
            "kv_usage": load.kv_usage if load is not None else None,
            "kv_total_blocks": load.total_blocks if load is not None else None,
            "num_running": load.num_running if load is not None else None,
            "num_waiting": load.num_waiting if load is not None else None,
            "router_active_decode_blocks": view[1] if view is not None else None,
            "prefix_hit_rate": window.rate if window is not None else None,
            "requests_served": self._served.get(iid, 0),
        }

    @staticmethod
    def _quantiles(families: list[Any], name: str, model: str) -> dict[str, float | None]:
        buckets = histogram_buckets(families, name, model)
        return {f"p{round(q * 100)}": histogram_quantile(q, buckets) for q in QUANTILES}


def _requests_by_model(families: Iterable[Any], name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in families:
        if family.name != name:
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                model = sample.labels["model"]
                out[model] = out.get(model, 0.0) + sample.value
    return out


def _decision_json(d: Decision) -> dict[str, Any]:
    return {
        "time": d.at,
        "request_id": d.request_id,
        "model": d.model,
        "worker_id": d.worker_id,
        "dp_rank": d.dp_rank,
        "overlap_blocks": d.overlap_blocks,
        "cost": d.cost,
        "outcome": d.outcome,
    }
