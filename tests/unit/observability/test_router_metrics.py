"""The dynamo_component_router_* families and the router-queue gauges (issue 17)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from dynamo.observability.router_metrics import RouterQueueGauges, RouterRequestMetrics

LABELS = {
    "dynamo_namespace": "ns",
    "dynamo_component": "backend",
    "dynamo_endpoint": "generate",
    "router_id": "42",
}


def _value(registry: CollectorRegistry, name: str, **extra: str) -> float | None:
    return registry.get_sample_value(name, {**LABELS, **extra})


def test_series_read_zero_from_their_router_creation_and_count_decisions() -> None:
    registry = CollectorRegistry()
    series = RouterRequestMetrics(registry, 42).bind("ns", "backend", "generate", "agg")
    assert _value(registry, "dynamo_component_router_requests_started_total") == 0.0
    assert _value(registry, "dynamo_component_router_requests_total") == 0.0
    # chosen rank holds 2 blocks of 16 where another eligible rank held 5: 3 blocks given up
    series.routed(100, 2, 16, [5, 2, 0])
    series.routed(100, 3, 16, None)  # pinned: nothing compared
    assert _value(registry, "dynamo_component_router_requests_started_total") == 2.0
    assert _value(registry, "dynamo_component_router_kv_selected_cached_prefix_tokens_total") == 80
    best = "dynamo_component_router_kv_best_eligible_cached_prefix_tokens_total"
    assert _value(registry, best) == 80.0 + 48.0
    lost = {"worker_type": "agg"}
    assert _value(registry, "dynamo_component_router_non_max_overlap_selections_total", **lost) == 1
    assert _value(registry, "dynamo_component_router_overlap_blocks_lost_sum", **lost) == 3.0
    assert _value(registry, "dynamo_component_router_kv_hit_rate_count") == 2.0
    series.ended(0.25, 0.01, 20, 64)
    series.ended(None, None, 0, None)  # failed before its first token
    assert _value(registry, "dynamo_component_router_requests_total") == 2.0
    assert _value(registry, "dynamo_component_router_time_to_first_token_seconds_count") == 1.0
    assert _value(registry, "dynamo_component_router_inter_token_latency_seconds_sum") == 0.01
    assert _value(registry, "dynamo_component_router_kv_worker_reused_tokens_total") == 64.0


def test_worker_registered_follows_the_ranks() -> None:
    registry = CollectorRegistry()
    series = RouterRequestMetrics(registry, 42).bind("ns", "backend", "generate", "prefill")
    rank = {"router_worker_id": "7", "dp_rank": "1", "worker_type": "prefill"}
    series.worker_registered(7, 1, True)
    assert _value(registry, "dynamo_component_router_worker_registered", **rank) == 1.0
    series.worker_registered(7, 1, False)
    series.worker_registered(7, 1, False)  # idempotent
    assert _value(registry, "dynamo_component_router_worker_registered", **rank) is None


def test_queue_gauges_sum_the_routers_of_a_worker_type() -> None:
    registry = CollectorRegistry()
    depths = [("agg", "default", 2, 300, 100, 1), ("agg", "default", 1, 50, 0, 2)]
    RouterQueueGauges("dynamo_frontend", registry, lambda: depths)
    labels = {"worker_type": "agg", "policy_class": "default"}
    get = registry.get_sample_value
    assert get("dynamo_frontend_router_queue_pending_requests", labels) == 3.0
    assert get("dynamo_frontend_router_queue_pending_isl_tokens", labels) == 350.0
    assert get("dynamo_frontend_router_queue_pending_cached_tokens", labels) == 100.0
    refused = {**labels, "reason": "request_limit"}
    assert get("dynamo_frontend_router_queue_backpressure_total", refused) == 3.0
    depths.clear()
    assert get("dynamo_frontend_router_queue_pending_requests", labels) is None
