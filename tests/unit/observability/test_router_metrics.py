"""The dynamo_component_router_* families and the router-queue gauges (issue 17)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from dynamo.observability.router_metrics import (
    RouterQueueGauges,
    RouterRequestMetrics,
    kv_transfer_bound,
)

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
    series = RouterRequestMetrics(registry, 42).bind("ns", "backend", "generate", "agg", "demo")
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
    series = RouterRequestMetrics(registry, 42).bind("ns", "backend", "generate", "prefill", "demo")
    rank = {"router_worker_id": "7", "dp_rank": "1", "worker_type": "prefill"}
    series.worker_registered(7, 1, True)
    assert _value(registry, "dynamo_component_router_worker_registered", **rank) == 1.0
    series.worker_registered(7, 1, False)
    series.worker_registered(7, 1, False)  # idempotent
    assert _value(registry, "dynamo_component_router_worker_registered", **rank) is None


def test_kv_transfer_bound_is_the_handoff_to_first_token_time_of_remote_prefills() -> None:
    registry = CollectorRegistry()
    series = RouterRequestMetrics(registry, 42).bind("ns", "backend", "generate", "decode", "demo")
    name = "dynamo_component_router_kv_transfer_estimated_latency_seconds"
    assert _value(registry, f"{name}_count") == 0.0
    # handoff at t=10.000 s, decode worker's first token at t=10.040 s: at most 40 ms
    assert kv_transfer_bound(10.0, 10.04) == pytest.approx(0.04)
    assert kv_transfer_bound(None, 10.04) is None  # prefilled locally
    assert kv_transfer_bound(10.0, None) is None  # no first token
    assert kv_transfer_bound(10.0, 9.99) == 0.0  # never negative
    series.ended(0.3, 0.01, 8, 0, kv_transfer_bound(10.0, 10.04))
    series.ended(0.1, 0.01, 8, 0, kv_transfer_bound(None, 20.0))
    assert _value(registry, f"{name}_count") == 1.0
    assert _value(registry, f"{name}_sum") == pytest.approx(0.04)
    # the reference's buckets, log(0.001, 10, 15): 0.04 falls between 0.027 and 0.052
    assert _value(registry, f"{name}_bucket", le="0.027") == 0.0
    assert _value(registry, f"{name}_bucket", le="0.052") == 1.0


def test_event_source_mismatches_carry_the_references_labels() -> None:
    registry = CollectorRegistry()
    series = RouterRequestMetrics(registry, 42).bind("ns", "backend", "generate", "decode", "demo")
    name = "dynamo_component_router_kv_event_source_mismatch_workers"
    target = {
        "model": "demo",
        "worker_type": "decode",
        "target_namespace": "ns",
        "target_component": "backend",
        "target_endpoint": "generate",
    }
    assert _value(registry, name, **target) == 0.0
    series.event_source_mismatches(2)
    assert _value(registry, name, **target) == 2.0


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
