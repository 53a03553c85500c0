"""``MockerConfig``: the mocker's settings (reference defaults, FACTS §6.1) and its CLI flags.

Every flag has a ``DYN_*`` environment twin (``dynamo.runtime.config.add_flag``). Runtime flags
(namespace, planes, ...) live in ``RuntimeConfig``; ``__main__`` adds both groups.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from dynamo.backend.disagg import role_component
from dynamo.engine_core.config import PREEMPTION_MODES, add_scheduler_flags
from dynamo.protocol.model_card import WorkerRole
from dynamo.runtime.config import add_flag

DISAGGREGATION_MODES = tuple(role.value for role in WorkerRole)
DEFAULT_CONTEXT_LENGTH = 32768
"""Used when neither ``--context-length`` nor the model's config gives one."""


@dataclass(frozen=True, slots=True)
class MockerConfig:
    """One mocker engine's settings. Block counts are per DP rank.

    ``kv_transfer_bandwidth`` defaults to 64 GB/s (the reference CLI's documented default) while
    ``kv_bytes_per_token`` defaults to unset: the KV transfer of a decode-side request costs nothing
    until the bytes per token are known (the reference's normalised config also charges nothing by
    default), and setting only ``--kv-bytes-per-token`` gives the documented 64 GB/s model.

    ``vocab_size`` and ``special_token_ids`` are not flags: ``__main__`` fills them from the model's
    tokenizer so that random output ids are valid, never special, tokens.
    """

    model_path: str | None = None
    model_name: str | None = None
    endpoint: str | None = None
    num_gpu_blocks: int = 16384
    block_size: int = 64
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    preemption_mode: str = "lifo"
    speedup_ratio: float = 1.0
    decode_speedup_ratio: float = 1.0
    data_parallel_size: int = 1
    num_workers: int = 1
    startup_time: float | None = None
    disaggregation_mode: str = "agg"
    kv_transfer_bandwidth: float | None = 64.0
    kv_bytes_per_token: int | None = None
    context_length: int | None = None
    vocab_size: int = 32000
    special_token_ids: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        _positive(
            num_gpu_blocks=self.num_gpu_blocks,
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            data_parallel_size=self.data_parallel_size,
            num_workers=self.num_workers,
            vocab_size=self.vocab_size,
        )
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption mode must be one of {PREEMPTION_MODES}")
        if self.disaggregation_mode not in DISAGGREGATION_MODES:
            raise ValueError(f"disaggregation mode must be one of {DISAGGREGATION_MODES}")
        if self.speedup_ratio < 0:
            raise ValueError("speedup ratio must be >= 0 (0 means no sleeping)")
        if self.decode_speedup_ratio <= 0:
            raise ValueError("decode speedup ratio must be positive")
        if self.startup_time is not None and self.startup_time < 0:
            raise ValueError("startup time must be >= 0")
        if self.kv_transfer_bandwidth is not None and self.kv_transfer_bandwidth < 0:
            raise ValueError("KV transfer bandwidth must be >= 0")
        if self.kv_bytes_per_token is not None and self.kv_bytes_per_token < 0:
            raise ValueError("KV bytes per token must be >= 0")
        if self.context_length is not None and self.context_length <= 0:
            raise ValueError("context length must be positive")
        if len(self.special_token_ids) >= self.vocab_size:
            raise ValueError("every vocabulary id is special: nothing to generate")

    @property
    def served_model_name(self) -> str:
        """The name clients use: ``--model-name``, else the model path, else ``dynamo-mocker``."""
        return self.model_name or self.model_path or "dynamo-mocker"

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + output) a request may have."""
        return self.context_length or DEFAULT_CONTEXT_LENGTH

    @property
    def total_kv_tokens(self) -> int:
        """Token capacity of one DP rank's KV pool (the decode-time model's denominator)."""
        return self.num_gpu_blocks * self.block_size

    def endpoint_for(self, namespace: str) -> str:
        """The endpoint to serve: ``--endpoint``, else ``dyn://{ns}.backend.generate`` (prefill
        workers: ``dyn://{ns}.prefill.generate``)."""
        if self.endpoint:
            return self.endpoint
        component = role_component(WorkerRole(self.disaggregation_mode))
        return f"dyn://{namespace}.{component}.generate"

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """Add the mocker's flags (reference names and defaults) as one argument group."""
        d = MockerConfig()
        g = parser.add_argument_group("mocker")
        add_flag(
            g, "--model-path", default=d.model_path, help="model directory or HF id (tokenizer)"
        )
        add_flag(g, "--model-name", default=d.model_name, help="served model name")
        add_flag(g, "--endpoint", default=d.endpoint, help="dyn://namespace.component.endpoint")
        add_flag(
            g,
            "--num-gpu-blocks-override",
            default=d.num_gpu_blocks,
            type=int,
            help="KV blocks per DP rank",
        )
        add_flag(g, "--block-size", default=d.block_size, type=int, help="tokens per KV block")
        add_scheduler_flags(g, d)
        add_flag(
            g,
            "--speedup-ratio",
            default=d.speedup_ratio,
            type=float,
            help="divide every simulated duration by this (0 = no sleeping at all)",
        )
        add_flag(
            g,
            "--decode-speedup-ratio",
            default=d.decode_speedup_ratio,
            type=float,
            help="additionally divide decode durations by this",
        )
        add_flag(
            g,
            "--data-parallel-size",
            default=d.data_parallel_size,
            type=int,
            help="independent schedulers and KV pools in one worker",
        )
        add_flag(
            g,
            "--num-workers",
            default=d.num_workers,
            type=int,
            help="mocker engines in this process, each its own worker id",
        )
        add_flag(
            g,
            "--startup-time",
            default=d.startup_time,
            type=float,
            help="seconds to sleep before serving (simulated model load)",
        )
        add_flag(
            g,
            "--disaggregation-mode",
            default=d.disaggregation_mode,
            choices=DISAGGREGATION_MODES,
            help="agg, prefill or decode worker",
        )
        add_flag(
            g,
            "--kv-transfer-bandwidth",
            default=d.kv_transfer_bandwidth,
            type=float,
            help="KV transfer bandwidth in GB/s (disaggregation; 0 disables)",
        )
        add_flag(
            g,
            "--kv-bytes-per-token",
            default=d.kv_bytes_per_token,
            type=int,
            help="KV bytes per token: layers * 2 * kv_heads * head_dim * dtype bytes",
        )
        add_flag(
            g,
            "--context-length",
            default=d.context_length,
            type=int,
            help=f"max prompt + output tokens (default: model's, else {DEFAULT_CONTEXT_LENGTH})",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides: Any) -> MockerConfig:
        """Build from parsed flags; ``overrides`` set non-flag fields (vocab, special ids)."""
        values: dict[str, Any] = {
            "model_path": args.model_path,
            "model_name": args.model_name,
            "endpoint": args.endpoint,
            "num_gpu_blocks": args.num_gpu_blocks_override,
            "block_size": args.block_size,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "enable_prefix_caching": args.enable_prefix_caching,
            "enable_chunked_prefill": args.enable_chunked_prefill,
            "preemption_mode": args.preemption_mode,
            "speedup_ratio": args.speedup_ratio,
            "decode_speedup_ratio": args.decode_speedup_ratio,
            "data_parallel_size": args.data_parallel_size,
            "num_workers": args.num_workers,
            "startup_time": args.startup_time,
            "disaggregation_mode": args.disaggregation_mode,
            "kv_transfer_bandwidth": args.kv_transfer_bandwidth,
            "kv_bytes_per_token": args.kv_bytes_per_token,
            "context_length": args.context_length,
        }
        values.update(overrides)
        return cls(**values)


def _positive(**values: int) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
