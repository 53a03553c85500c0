"""The model deployment card a worker registers in discovery (key ``v1/mdc/...``)."""

from __future__ import annotations

from enum import StrEnum

import msgspec


class WorkerRole(StrEnum):
    AGGREGATED = "agg"
    PREFILL = "prefill"
    DECODE = "decode"


class ModelCard(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a frontend needs to serve a model from a worker.

    ``tokenizer_checksum`` identifies the tokenizer files: workers of one model must agree on it.
    """

    served_model_name: str
    model_path: str
    namespace: str
    component: str
    endpoint: str
    instance_id: int
    context_length: int
    kv_block_size: int
    total_kv_blocks: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    data_parallel_start_rank: int = 0
    data_parallel_size: int = 1
    role: WorkerRole = WorkerRole.AGGREGATED
    tokenizer_checksum: str | None = None
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
