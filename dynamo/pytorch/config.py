"""``TorchEngineConfig``: the PyTorch engine's settings and CLI flags (vLLM's names where the
concept exists), each with its ``DYN_*`` environment twin."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import Any

from dynamo.runtime.config import add_flag

DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16")
PREEMPTION_MODES = ("lifo", "fifo")
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

    def __post_init__(self) -> None:
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
        add_flag(
            g, "--max-num-seqs", default=d.max_num_seqs, type=int, help="most running requests"
        )
        add_flag(
            g,
            "--max-num-batched-tokens",
            default=d.max_num_batched_tokens,
            type=int,
            help="token budget of one forward pass",
        )
        add_flag(
            g,
            "--enable-prefix-caching",
            default=d.enable_prefix_caching,
            type=bool,
            help="reuse cached prompt blocks",
        )
        add_flag(
            g,
            "--enable-chunked-prefill",
            default=d.enable_chunked_prefill,
            type=bool,
            help="split long prompts over several passes",
        )
        add_flag(
            g,
            "--preemption-mode",
            default=d.preemption_mode,
            choices=PREEMPTION_MODES,
            help="which running request to preempt under KV pressure (lifo = newest)",
        )
        add_flag(
            g,
            "--context-length",
            default=d.context_length,
            type=int,
            help="max prompt + output tokens (default: the model's max_position_embeddings)",
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
