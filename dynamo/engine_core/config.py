"""``SchedulerLimits``: what the shared scheduler needs to know about an engine's configuration.

Both engines' configs satisfy it structurally (``MockerConfig``, ``TorchEngineConfig``): one
policy, whatever the engine behind it, and one set of flags for it (:func:`add_scheduler_flags`).
"""

from __future__ import annotations

from typing import Any, Protocol

from dynamo.runtime.config import add_flag

PREEMPTION_MODES = ("lifo", "fifo")


class SchedulerPolicy(Protocol):
    """The scheduler settings an engine's flags set (:func:`add_scheduler_flags`)."""

    @property
    def max_num_seqs(self) -> int: ...

    @property
    def max_num_batched_tokens(self) -> int: ...

    @property
    def enable_prefix_caching(self) -> bool: ...

    @property
    def enable_chunked_prefill(self) -> bool: ...

    @property
    def preemption_mode(self) -> str:
        """``lifo`` (preempt the newest running request) or ``fifo`` (the oldest)."""
        ...


class SchedulerLimits(SchedulerPolicy, Protocol):
    """Read-only view of the limits one DP rank's scheduler works within."""

    @property
    def block_size(self) -> int: ...

    @property
    def num_gpu_blocks(self) -> int: ...

    @property
    def disaggregation_mode(self) -> str:
        """``agg``, ``prefill`` or ``decode``."""
        ...

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + output) a request may have."""
        ...

    @property
    def total_kv_tokens(self) -> int: ...


def add_scheduler_flags(group: Any, defaults: SchedulerPolicy) -> None:
    """The scheduler's flags (vLLM's names), each with its ``DYN_*`` twin, on an engine's
    argument ``group``, defaulting to that engine's ``defaults``."""
    d = defaults
    add_flag(
        group,
        "--max-num-seqs",
        default=d.max_num_seqs,
        type=int,
        help="most running requests per DP rank",
    )
    add_flag(
        group,
        "--max-num-batched-tokens",
        default=d.max_num_batched_tokens,
        type=int,
        help="token budget of one forward pass",
    )
    add_flag(
        group,
        "--enable-prefix-caching",
        default=d.enable_prefix_caching,
        type=bool,
        help="reuse cached prompt blocks",
    )
    add_flag(
        group,
        "--enable-chunked-prefill",
        default=d.enable_chunked_prefill,
        type=bool,
        help="split long prompts over several passes",
    )
    add_flag(
        group,
        "--preemption-mode",
        default=d.preemption_mode,
        choices=PREEMPTION_MODES,
        help="which running request to preempt under KV pressure (lifo = newest)",
    )
