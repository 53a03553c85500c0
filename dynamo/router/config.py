"""The KV router's settings and flags (reference names, FACTS §4)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from dynamo.router.selector import SelectorConfig
from dynamo.runtime.config import add_flag

QUEUE_POLICIES = ("fcfs", "wspt", "lcfs")


@dataclass(frozen=True, slots=True)
class KVRouterSettings:
    """The KV router's knobs (reference flag names, FACTS §4)."""

    temperature: float = 0.0
    overlap_score_credit: float = 1.0
    overlap_score_weight: float = 1.0
    use_kv_events: bool = True
    replica_sync: bool = False
    ttl_secs: float = 120.0
    active_decode_blocks_threshold: float | None = None
    active_prefill_tokens_threshold: int | None = None
    active_prefill_tokens_threshold_frac: float | None = None
    track_active_blocks: bool = True
    track_prefill_tokens: bool = True
    assume_kv_reuse: bool = True
    decode_active_request_weight: float = 0.0
    overlap_score_credit_decay: float = 0.0
    consistency_check_interval_s: float = 30.0
    queue_threshold: float | None = None  # None: no router queue (FACTS §4.5)
    queue_policy: str = "fcfs"
    queue_max_requests: int | None = None  # None: unbounded

    def __post_init__(self) -> None:
        if self.queue_threshold is not None and not self.queue_threshold >= 0:
            raise ValueError("--router-queue-threshold must be >= 0")
        if self.queue_policy not in QUEUE_POLICIES:
            raise ValueError(f"--router-queue-policy must be one of {', '.join(QUEUE_POLICIES)}")
        if self.queue_max_requests is not None and self.queue_max_requests < 1:
            raise ValueError("--router-queue-max-requests must be at least 1")

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        d = KVRouterSettings()
        g = parser.add_argument_group("kv router")
        add_flag(
            g,
            "--router-temperature",
            default=d.temperature,
            type=float,
            help="softmax temperature over worker costs (0 = pick the cheapest)",
        )
        add_flag(
            g,
            "--router-kv-overlap-score-credit",
            default=d.overlap_score_credit,
            type=float,
            help="credit per cached block against prefill cost",
        )
        add_flag(
            g,
            "--kv-overlap-score-weight",
            default=d.overlap_score_weight,
            type=float,
            help="weight of the prefill term (prefill_load_scale)",
        )
        add_flag(
            g,
            "--router-kv-events",
            default=d.use_kv_events,
            type=bool,
            help="index KV events from workers (--no-router-kv-events: approximate mode)",
        )
        parser.add_argument(
            "--no-kv-events",
            dest="router_kv_events",
            action="store_false",
            help="alias of --no-router-kv-events",
        )
        add_flag(
            g,
            "--router-replica-sync",
            default=d.replica_sync,
            type=bool,
            help="share active-load changes with other routers of the model",
        )
        add_flag(
            g,
            "--router-ttl-secs",
            default=d.ttl_secs,
            type=float,
            help="approximate mode: how long a routed prefix counts as cached",
        )
        add_flag(
            g,
            "--active-decode-blocks-threshold",
            default=None,
            type=float,
            help="busy when active decode blocks exceed this fraction of KV capacity",
        )
        add_flag(
            g,
            "--active-prefill-tokens-threshold",
            default=None,
            type=int,
            help="busy when active prefill tokens exceed this",
        )
        add_flag(
            g,
            "--active-prefill-tokens-threshold-frac",
            default=None,
            type=float,
            help="busy when active prefill tokens exceed this fraction of max_num_batched_tokens",
        )
        add_flag(
            g,
            "--router-track-prefill-tokens",
            default=d.track_prefill_tokens,
            type=bool,
            help="count prompt tokens in a worker's load (off for decode-only routers)",
        )
        add_flag(
            g,
            "--router-decode-active-request-weight",
            default=d.decode_active_request_weight,
            type=float,
            help="cost per active request on a worker",
        )
        add_flag(
            g,
            "--router-kv-overlap-score-credit-decay",
            default=d.overlap_score_credit_decay,
            type=float,
            help="shrink the cache-hit credit of workers with more prefill queued than the least",
        )
        add_flag(
            g,
            "--router-track-active-blocks",
            default=d.track_active_blocks,
            type=bool,
            help="account active decode blocks per worker",
        )
        add_flag(
            g,
            "--router-kv-consistency-interval",
            default=d.consistency_check_interval_s,
            type=float,
            help="seconds between checks of the KV index against each worker's own (0: off)",
        )
        add_flag(
            g,
            "--router-assume-kv-reuse",
            default=d.assume_kv_reuse,
            type=bool,
            help="deduplicate identical prefixes in active-block accounting",
        )
        add_flag(
            g,
            "--router-queue-threshold",
            default=None,
            type=float,
            help="hold requests while every eligible worker has more active prefill tokens than "
            "this fraction of its max_num_batched_tokens, and route them when capacity frees "
            "(unset: no router queue)",
        )
        add_flag(
            g,
            "--router-queue-policy",
            default=d.queue_policy,
            choices=QUEUE_POLICIES,
            help="order of held requests: fcfs (priority bump = earlier arrival; tail TTFT), "
            "wspt (Smith's rule on uncached prompt tokens; mean TTFT), lcfs (experiments)",
        )
        add_flag(
            g,
            "--router-queue-max-requests",
            default=None,
            type=int,
            help="most requests the router queue holds; one more is refused with 529 "
            "(unset: unbounded)",
        )

    def selector_config(self) -> SelectorConfig:
        return SelectorConfig(
            overlap_score_credit=self.overlap_score_credit,
            prefill_load_scale=self.overlap_score_weight,
            temperature=self.temperature,
            active_decode_blocks_threshold=self.active_decode_blocks_threshold,
            active_prefill_tokens_threshold=self.active_prefill_tokens_threshold,
            active_prefill_tokens_threshold_frac=self.active_prefill_tokens_threshold_frac,
            track_prefill_tokens=self.track_prefill_tokens,
            decode_active_request_weight=self.decode_active_request_weight,
            overlap_score_credit_decay=self.overlap_score_credit_decay,
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> KVRouterSettings:
        return cls(
            temperature=args.router_temperature,
            overlap_score_credit=args.router_kv_overlap_score_credit,
            overlap_score_weight=args.kv_overlap_score_weight,
            use_kv_events=args.router_kv_events,
            replica_sync=args.router_replica_sync,
            ttl_secs=args.router_ttl_secs,
            active_decode_blocks_threshold=args.active_decode_blocks_threshold,
            active_prefill_tokens_threshold=args.active_prefill_tokens_threshold,
            active_prefill_tokens_threshold_frac=args.active_prefill_tokens_threshold_frac,
            track_prefill_tokens=args.router_track_prefill_tokens,
            decode_active_request_weight=args.router_decode_active_request_weight,
            overlap_score_credit_decay=args.router_kv_overlap_score_credit_decay,
            track_active_blocks=args.router_track_active_blocks,
            assume_kv_reuse=args.router_assume_kv_reuse,
            consistency_check_interval_s=args.router_kv_consistency_interval,
            queue_threshold=args.router_queue_threshold,
            queue_policy=args.router_queue_policy,
            queue_max_requests=args.router_queue_max_requests,
        )
