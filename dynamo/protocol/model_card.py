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


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def compute_tokenizer_checksum(model_path: str) -> str | None:
    """sha256 over the model directory's tokenizer files (None if it has none).

    Workers put it in their card; the frontend refuses a worker whose checksum disagrees with the
    pipeline already built for that model.
    """
    import hashlib
    import os

    digest = hashlib.sha256()
    found = False
    for name in TOKENIZER_FILES:
        path = os.path.join(model_path, name)
        if os.path.isfile(path):
            found = True
            digest.update(name.encode())
            with open(path, "rb") as fh:
                digest.update(fh.read())
    return digest.hexdigest() if found else None
