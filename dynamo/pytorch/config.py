"""``TorchEngineConfig``: the PyTorch engine's settings and CLI flags (vLLM's names where the
concept exists), each with its ``DYN_*`` environment twin."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import Any

from dynamo.engine_core.config import PREEMPTION_MODES, add_scheduler_flags
from dynamo.protocol.model_card import WorkerRole
from dynamo.runtime.config import add_flag

DISAGGREGATION_MODES = tuple(role.value for role in WorkerRole)
DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16")
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kmg]?)(?:i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_bytes(text: str) -> int:
    """``"512MiB"``, ``"2g"``, ``"1048576"`` -> bytes (binary units)."""
    match = _SIZE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MiB, 2GiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


@dataclass(frozen=True, slots=True)
class TorchEngineConfig:
    """One PyTorch engine. ``num_gpu_blocks`` is resolved at load time from
    ``num_gpu_blocks_override`` or ``kv_cache_memory`` (``SchedulerSettings``)."""

    model_path: str = ""
    model_name: str | None = None
    endpoint: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 16
    num_gpu_blocks_override: int | None = None
    kv_cache_memory: int = 1 << 30
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    preemption_mode: str = "lifo"
    context_length: int | None = None
    torch_threads: int | None = None
    disaggregation_mode: str = "agg"
    kv_transfer_host: str = "127.0.0.1"
    kv_transfer_port: int = 0

    def __post_init__(self) -> None:
        if self.disaggregation_mode not in DISAGGREGATION_MODES:
            raise ValueError(f"disaggregation mode must be one of {DISAGGREGATION_MODES}")
        if not 0 <= self.kv_transfer_port < 65536:
            raise ValueError("kv transfer port must be in [0, 65536)")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption mode must be one of {PREEMPTION_MODES}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        for name in ("num_gpu_blocks_override", "context_length", "torch_threads"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive")

    @property
    def served_model_name(self) -> str:
        return self.model_name or self.model_path

    @property
    def role(self) -> WorkerRole:
        return WorkerRole(self.disaggregation_mode)

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        d = TorchEngineConfig()
        g = parser.add_argument_group("pytorch engine")
        add_flag(g, "--model-path", default=d.model_path, help="Hugging Face model directory")
        add_flag(g, "--model-name", default=d.model_name, help="served model name")
        add_flag(g, "--endpoint", default=d.endpoint, help="dyn://namespace.component.endpoint")
        add_flag(g, "--device", default=d.device, choices=DEVICES, help="where the model runs")
        add_flag(g, "--dtype", default=d.dtype, choices=DTYPES, help="weights and KV dtype")
        add_flag(g, "--block-size", default=d.block_size, type=int, help="tokens per KV block")
        add_flag(
            g,
            "--num-gpu-blocks-override",
            default=d.num_gpu_blocks_override,
            type=int,
            help="KV blocks in the pool (default: sized from --kv-cache-memory)",
        )
        add_flag(
            g,
            "--kv-cache-memory",
            default=d.kv_cache_memory,
            type=parse_bytes,
            help="bytes of KV pool (e.g. 512MiB, 2GiB)",
        )
        add_scheduler_flags(g, d)
        add_flag(
            g,
            "--context-length",
            default=d.context_length,
            type=int,
            help="max prompt + output tokens (default: the model's max_position_embeddings)",
        )
        add_flag(
            g,
            "--disaggregation-mode",
            default=d.disaggregation_mode,
            choices=DISAGGREGATION_MODES,
            help="agg, prefill (run prompts, hand their KV off) or decode (resume from a handoff)",
        )
        add_flag(
            g,
            "--kv-transfer-host",
            default=d.kv_transfer_host,
            help="address of this worker's KV transfer agent (disaggregation)",
        )
        add_flag(
            g,
            "--kv-transfer-port",
            default=d.kv_transfer_port,
            type=int,
            help="port of this worker's KV transfer agent (0: any free port)",
        )
        add_flag(
            g,
            "--torch-threads",
            default=d.torch_threads,
            type=int,
            help="torch intra-op threads (default: torch's choice)",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides: Any) -> TorchEngineConfig:
        names = [f for f in cls.__dataclass_fields__]
        values: dict[str, Any] = {n: getattr(args, n) for n in names if hasattr(args, n)}
        values.update(overrides)
        return cls(**values)


@dataclass(frozen=True, slots=True)
class SchedulerSettings:
    """The engine's config resolved against its model: satisfies ``SchedulerLimits``."""

    block_size: int
    num_gpu_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool
    enable_chunked_prefill: bool
    preemption_mode: str
    max_model_len: int
    disaggregation_mode: str = "agg"

    @property
    def total_kv_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size
