"""``DynamoConnector``: our vLLM KV connector (vLLM's ``KVConnectorBase_V1`` API), so that a
prompt prefilled on one vLLM worker is decoded on another (spec 000's prefill and decode roles).

vLLM loads it by module path (``kv_transfer_config.kv_connector_module_path`` =
``dynamo.vllm.connector``, set by ``VllmEngine`` for a prefill or decode worker) in its
engine-core process, twice: a *scheduler* connector beside vLLM's scheduler (bookkeeping, this
module) and a *worker* connector beside the KV tensors (``kv_handoff.HandoffWorker``: our transfer
agent on a private loop). vLLM's CPU build runs them: its ``CPUWorker`` and ``CPUModelRunner``
are the GPU worker and runner's subclasses and keep their connector calls
(``ensure_kv_transfer_initialized``, ``register_kv_caches``, the per-step metadata,
``get_transfer_results``).

A handoff (the ``kv_transfer_params`` of vLLM's requests and outputs):

1. prefill worker, request ``{"do_remote_decode": true}``: when it ends (its one token, or a stop),
   ``request_finished`` keeps its blocks (``delay_free``) and answers the params of the decode
   side: ``remote_host``/``remote_port`` (this worker's agent, learned from the worker connector
   by vLLM's handshake), ``remote_handle`` (the request id), ``remote_block_ids``.
2. decode worker, request with those params plus ``do_remote_prefill``: the prompt's full blocks
   beyond the decode worker's own prefix hit are loaded *asynchronously* (vLLM parks the request
   in ``WAITING_FOR_REMOTE_KVS`` and keeps stepping the others) into the blocks vLLM allocated;
   the prompt's last partial block (and always its last token) is computed here, as vLLM's own
   connectors do. A request with nothing to load still pulls nothing, which ends the handoff.
3. prefill worker: the pull ends the handoff; vLLM frees the blocks.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.request import RequestStatus

from dynamo.backend.kv_transfer import TransferStats
from dynamo.vllm.kv_handoff import HOLD_TIMEOUT_S, HandoffWorker, Load
from dynamo.vllm.paged_kv import PagedKV

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

CONNECTOR_NAME = "DynamoConnector"
# A prompt is handed off when its one token came (its length) or was a stop token: the decode
# side then samples that token again and stops the same way.
_HANDED_OFF = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


@dataclass
class DynamoHandshake(KVConnectorHandshakeMetadata):  # type: ignore[misc]
    """The worker connector's agent address, for the scheduler connector's handoff params."""

    host: str
    port: int


@dataclass
class DynamoConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's orders from the scheduler connector to the worker connector."""

    holds: dict[str, list[int]] = field(default_factory=dict)
    loads: dict[str, Load] = field(default_factory=dict)


# the transfer agent's own totals (``TransferStats``): pulls served are handoffs sent, pulls
# made are loads
_STAT_KEYS = tuple(f.name for f in fields(TransferStats))


@dataclass
class DynamoTransferStats(KVConnectorStats):  # type: ignore[misc]
    """Transfer totals since the last report (vLLM's connector stats: they reach the stat
    loggers as ``SchedulerStats.kv_connector_stats``, a dict of these keys; ``stats.py`` adds
    them up for the worker's ``dynamo_component_kv_transfer_*`` counters)."""

    def __post_init__(self) -> None:
        for key in _STAT_KEYS:
            self.data.setdefault(key, 0)

    def reset(self) -> None:
        self.data = dict.fromkeys(_STAT_KEYS, 0)

    def aggregate(self, other: KVConnectorStats) -> DynamoTransferStats:
        for key in _STAT_KEYS:
            self.data[key] += other.data.get(key, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class DynamoConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """``kv_connector_extra_config``: ``host`` (where the agent listens, default 127.0.0.1),
    ``port`` (default 0: a free one), ``hold_timeout_s``."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._host = str(extra.get("host", "127.0.0.1"))
        self._port = int(extra.get("port", 0))
        self._hold_timeout_s = float(extra.get("hold_timeout_s", HOLD_TIMEOUT_S))
        self._block_size = int(vllm_config.cache_config.block_size)
        self._num_blocks = int(kv_cache_config.num_blocks)
        # scheduler side
        self._agent_address: tuple[str, int] | None = None
        self._matched: dict[str, int] = {}  # request id -> locally computed tokens at match
        self._meta = DynamoConnectorMetadata()
        # worker side
        self._worker: HandoffWorker | None = None
        self._reported: dict[str, float] = dict.fromkeys(_STAT_KEYS, 0)
        if role == KVConnectorRole.WORKER:
            log.info("dynamo KV connector (worker side) for %d blocks", self._num_blocks)

    # -- worker side ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        kv = PagedKV(dict(kv_caches), self._num_blocks, self._block_size)
        self._worker = HandoffWorker(
            kv, host=self._host, port=self._port, hold_timeout_s=self._hold_timeout_s
        )
        port = self._worker.start()
        log.info("dynamo KV connector agent on %s:%d", self._host, port)

    def get_handshake_metadata(self) -> DynamoHandshake | None:
        worker = self._worker
        return None if worker is None else DynamoHandshake(worker.host, worker.port)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        worker = self._worker
        meta = self._get_connector_metadata()
        assert worker is not None and isinstance(meta, DynamoConnectorMetadata)
        for request_id, block_ids in meta.holds.items():
            worker.hold(request_id, block_ids)
        for request_id, load in meta.loads.items():
            worker.load(request_id, load)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are asynchronous: a loading request is not scheduled until it is in."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Nothing is saved: a prefill worker serves its held blocks in place."""

    def wait_for_save(self) -> None:
        """Nothing is saved (see ``save_kv_layer``)."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        sent, received, _ = self._take()
        return sent, received

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sent, received, failed = self._take()
        return KVConnectorTransferResults(
            finished_sending=sent, finished_recving=received, failed_recving=failed
        )

    def get_kv_connector_stats(self) -> DynamoTransferStats | None:
        worker = self._worker
        if worker is None:
            return None
        now: dict[str, float] = asdict(worker.stats)
        delta = {k: now[k] - self._reported[k] for k in _STAT_KEYS}
        self._reported = now
        stats = DynamoTransferStats(data=delta)
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> DynamoTransferStats:
        return DynamoTransferStats(data=dict(data or {}))

    def _take(self) -> tuple[set[str], set[str], set[str]]:
        if self._worker is None:
            return set(), set(), set()
        return self._worker.take_finished()

    def shutdown(self) -> None:
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.close()

    # -- scheduler side ------------------------------------------------------------------------
    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        first = metadata.get(0)
        if isinstance(first, DynamoHandshake):
            self._agent_address = (first.host, first.port)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        remote_blocks = len(params.get("remote_block_ids") or ())
        # Full blocks only, and never the prompt's last token: vLLM computes at least one.
        full = min(remote_blocks, (request.num_prompt_tokens - 1) // self._block_size)
        count = full * self._block_size - num_computed_tokens
        self._matched[request.request_id] = num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # once: not again after a preemption
        local = self._matched.pop(request.request_id, 0)
        first = local // self._block_size
        count = num_external_tokens // self._block_size
        local_ids = list(blocks.get_block_ids()[0][first : first + count]) if count else []
        remote_ids = list(params["remote_block_ids"][first : first + count]) if count else []
        self._meta.loads[request.request_id] = Load(
            host=str(params["remote_host"]),
            port=int(params["remote_port"]),
            handle=str(params["remote_handle"]),
            remote_ids=remote_ids,
            local_ids=local_ids,
        )

    def build_connector_meta(self, scheduler_output: Any) -> DynamoConnectorMetadata:
        meta, self._meta = self._meta, DynamoConnectorMetadata()
        return meta

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._matched.pop(request.request_id, None)
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_decode"):
            return False, None
        if request.status not in _HANDED_OFF or not block_ids:
            return False, None  # aborted or failed: nothing to hand off
        if self._agent_address is None:
            log.error("no KV agent address from the worker connector: no handoff")
            return False, None
        host, port = self._agent_address
        self._meta.holds[request.request_id] = list(block_ids)
        return True, {
            "remote_host": host,
            "remote_port": port,
            "remote_handle": request.request_id,
            "remote_block_ids": list(block_ids),
        }
