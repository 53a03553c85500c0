"""The model deployment card a worker registers in discovery (key ``v1/mdc/...``)."""

from __future__ import annotations

from enum import StrEnum

import msgspec


class WorkerRole(StrEnum):
    AGGREGATED = "agg"
    PREFILL = "prefill"
    DECODE = "decode"


class EngineCapabilities(msgspec.Struct, kw_only=True, omit_defaults=True, frozen=True):
    """What an engine honours beyond the basic sampling fields (temperature, top_p, top_k, seed,
    max/min tokens, stop, ignore_eos, n). The frontend answers 400, naming the field, when a
    request asks for something its model's engine does not advertise here: no field is ever
    accepted and silently dropped.
    """

    logprobs: bool = False
    max_top_logprobs: int = 0
    prompt_logprobs: bool = False
    min_p: bool = False
    repetition_penalty: bool = False
    presence_penalty: bool = False
    frequency_penalty: bool = False
    guided_decoding: bool = False


class ModelCard(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a frontend needs to serve a model from a worker.

    ``tokenizer_checksum`` identifies the tokenizer files: workers of one model must agree on it.
    ``files_prefix`` is where the worker published those files (and ``config.json``) in
    discovery, so a frontend on any host builds the pipeline without the worker's disk;
    ``model_path`` is informative only when it is set.
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
    files_prefix: str | None = None
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    capabilities: EngineCapabilities = msgspec.field(default_factory=EngineCapabilities)
    migration_limit: int = 0
    """How many times a request to this worker may be migrated to another instance when its
    stream fails (the worker's ``--migration-limit``; a frontend's own flag overrides it)."""
    kv_events: bool = True
    """The worker publishes KV events. False: explicitly disabled (vLLM's ``--no-kv-events``),
    which a KV router that follows events counts in ``router_kv_event_source_mismatch_workers``
    (the reference's runtime config ``kv_event_publishing_enabled``)."""
