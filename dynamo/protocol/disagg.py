"""Disaggregation handoff: what a prefill worker hands to a decode worker (spec 003)."""

from __future__ import annotations

import msgspec


class DisaggregatedParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """The KV handoff a prefill worker returns on its terminal chunk.

    The decode side needs the prompt's block hashes (to know which KV it receives), the prefill
    worker's identity (where to pull KV from) and the number of prompt tokens (transfer size).
    ``engine_specific`` carries opaque engine metadata (e.g. vLLM kv_transfer_params).
    """

    prefill_worker_id: int
    prefill_dp_rank: int = 0
    block_hashes: list[int] = msgspec.field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    engine_specific: dict[str, object] | None = None
