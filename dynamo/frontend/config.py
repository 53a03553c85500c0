"""Frontend configuration: flags with ``DYN_*`` twins, one frozen dataclass."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from dynamo.frontend.disagg import DisaggSettings
from dynamo.frontend.offload import TOKENIZE_IN
from dynamo.router.config import KVRouterSettings
from dynamo.runtime.config import RuntimeConfig, add_flag
from dynamo.runtime.http_limits import HttpLimits

ROUTER_MODES = ("round-robin", "random", "kv")


@dataclass(frozen=True, slots=True)
class FrontendConfig:
    http_host: str = "0.0.0.0"
    http_port: int = 8000
    router_mode: str = "round-robin"
    metrics_prefix: str = "dynamo_frontend"
    max_inflight: int = 4096
    overload_status: int = 529
    body_limit_mb: float = 45.0
    model_retention_s: float = 60.0
    first_response_timeout_s: float = 600.0
    inter_chunk_timeout_s: float = 300.0
    sse_keep_alive_s: float = 10.0
    migration_limit: int | None = None  # None: each model's workers advertise theirs
    migration_max_seq_len: int | None = None
    instance_probe_interval_s: float = 1.0
    admission_factor: float = 2.0
    preprocess_threads: int = 2
    preprocess_queue: int = 16
    tokenize_in: str = "process"
    limits: HttpLimits = field(default_factory=HttpLimits)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    kv: KVRouterSettings = field(default_factory=KVRouterSettings)
    disagg: DisaggSettings = field(default_factory=DisaggSettings)

    def __post_init__(self) -> None:
        if self.router_mode not in ROUTER_MODES:
            raise ValueError(f"router mode must be one of {ROUTER_MODES}")
        if self.max_inflight < 1:
            raise ValueError("max in-flight requests must be at least 1")
        if self.overload_status not in (503, 529):
            raise ValueError("overload status must be 503 or 529")
        if self.admission_factor < 0:
            raise ValueError("admission factor must be >= 0 (0 disables load shedding)")
        if self.tokenize_in not in TOKENIZE_IN:
            raise ValueError(f"tokenize in must be one of {TOKENIZE_IN}")
        if self.preprocess_threads < 1 or self.preprocess_queue < 1:
            raise ValueError("preprocess threads and queue must be at least 1")
        for name in ("first_response_timeout_s", "inter_chunk_timeout_s", "sse_keep_alive_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 disables it)")
        if self.migration_limit is not None and self.migration_limit < 0:
            raise ValueError("the migration limit must be >= 0")
        if self.migration_max_seq_len is not None and self.migration_max_seq_len < 1:
            raise ValueError("the migration max sequence length must be >= 1")
        if self.instance_probe_interval_s <= 0:
            raise ValueError("the instance probe interval must be > 0")
        if self.kv.queue_threshold is not None and self.router_mode != "kv":
            raise ValueError("--router-queue-threshold needs --router-mode kv (the KV router)")

    @property
    def body_limit_bytes(self) -> int:
        return int(self.body_limit_mb * 1024 * 1024)

    @staticmethod
    def build_parser() -> argparse.ArgumentParser:
        d = FrontendConfig()
        parser = argparse.ArgumentParser(
            "dynamo frontend", description="OpenAI-compatible frontend"
        )
        add_flag(parser, "--http-host", default=d.http_host, help="HTTP listen address")
        add_flag(parser, "--http-port", default=d.http_port, type=int, help="HTTP port (0: any)")
        add_flag(
            parser,
            "--router-mode",
            default=d.router_mode,
            choices=ROUTER_MODES,
            help="how a worker is picked",
        )
        add_flag(parser, "--metrics-prefix", default=d.metrics_prefix, help="Prometheus prefix")
        add_flag(
            parser,
            "--max-inflight-requests",
            default=d.max_inflight,
            type=int,
            help="requests in flight before new ones are refused with --overload-status",
        )
        add_flag(
            parser,
            "--overload-status",
            default=d.overload_status,
            type=int,
            choices=(503, 529),
            env="DYN_HTTP_OVERLOAD_STATUS_CODE",
            help="status for overload rejections",
        )
        add_flag(
            parser,
            "--body-limit-mb",
            default=d.body_limit_mb,
            type=float,
            env="DYN_HTTP_BODY_LIMIT_MB",
            help="largest accepted request body",
        )
        add_flag(
            parser,
            "--model-retention-secs",
            default=d.model_retention_s,
            type=float,
            help="how long a model whose workers all left answers 503 instead of 404",
        )
        add_flag(
            parser,
            "--first-response-timeout-secs",
            default=d.first_response_timeout_s,
            type=float,
            help="an attempt whose worker sends no first response within this fails with 504 "
            "(0: no limit)",
        )
        add_flag(
            parser,
            "--inter-chunk-timeout-secs",
            default=d.inter_chunk_timeout_s,
            type=float,
            help="an attempt whose worker then stays silent this long fails with 504 (0: no limit)",
        )
        add_flag(
            parser,
            "--sse-keep-alive-secs",
            default=d.sse_keep_alive_s,
            type=float,
            help="an SSE stream idle this long gets a ': keep-alive' comment (0: never)",
        )
        add_flag(
            parser,
            "--migration-limit",
            default=d.migration_limit,
            type=int,
            help="times a request whose worker fails may continue on another worker "
            "(0: never; unset: what each model's workers advertise)",
        )
        add_flag(
            parser,
            "--migration-max-seq-len",
            default=d.migration_max_seq_len,
            type=int,
            help="a request whose prompt + generated tokens exceed this is not migrated "
            "(unset: no limit)",
        )
        add_flag(
            parser,
            "--instance-probe-interval-secs",
            default=d.instance_probe_interval_s,
            type=float,
            help="how often an instance taken out of routing after a failure is probed to "
            "bring it back (also the probe's timeout)",
        )
        add_flag(
            parser,
            "--admission-factor",
            default=d.admission_factor,
            type=float,
            help="load shedding: a model admits this many times the requests its workers "
            "advertise they run at once (max_num_seqs); more get --overload-status at once "
            "(0: no shedding)",
        )
        add_flag(
            parser,
            "--preprocess-threads",
            default=d.preprocess_threads,
            type=int,
            help="threads that decode, template and tokenize large requests off the event loop",
        )
        add_flag(
            parser,
            "--preprocess-queue",
            default=d.preprocess_queue,
            type=int,
            help="large requests preprocessed at once; more are refused with --overload-status",
        )
        add_flag(
            parser,
            "--tokenize-in",
            default=d.tokenize_in,
            choices=TOKENIZE_IN,
            help="where the prompts of concurrent requests are tokenized, in batches: a child "
            "process (the event loop never waits for the GIL to get the ids back) or a thread "
            "of the frontend; a request alone is tokenized on the event loop either way",
        )
        HttpLimits.add_arguments(parser)
        RuntimeConfig.add_arguments(parser)
        KVRouterSettings.add_arguments(parser)
        DisaggSettings.add_arguments(parser)
        return parser

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> FrontendConfig:
        return cls(
            http_host=args.http_host,
            http_port=args.http_port,
            router_mode=args.router_mode,
            metrics_prefix=args.metrics_prefix,
            max_inflight=args.max_inflight_requests,
            overload_status=args.overload_status,
            body_limit_mb=args.body_limit_mb,
            model_retention_s=args.model_retention_secs,
            first_response_timeout_s=args.first_response_timeout_secs,
            inter_chunk_timeout_s=args.inter_chunk_timeout_secs,
            sse_keep_alive_s=args.sse_keep_alive_secs,
            migration_limit=args.migration_limit,
            migration_max_seq_len=args.migration_max_seq_len,
            instance_probe_interval_s=args.instance_probe_interval_secs,
            admission_factor=args.admission_factor,
            preprocess_threads=args.preprocess_threads,
            preprocess_queue=args.preprocess_queue,
            tokenize_in=args.tokenize_in,
            limits=HttpLimits.from_args(args),
            runtime=RuntimeConfig.from_args(args),
            kv=KVRouterSettings.from_args(args),
            disagg=DisaggSettings.from_args(args),
        )
