"""``SchedulerLimits``: what the shared scheduler needs to know about an engine's configuration.

Both engines' configs satisfy it structurally (``MockerConfig``, ``TorchEngineConfig``): one
policy, whatever the engine behind it.
"""

from __future__ import annotations

from typing import Protocol


class SchedulerLimits(Protocol):
    """Read-only view of the limits one DP rank's scheduler works within."""

    @property
    def block_size(self) -> int: ...

    @property
    def num_gpu_blocks(self) -> int: ...

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
