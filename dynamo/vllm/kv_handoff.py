"""The worker side of the vLLM disaggregation connector: KV handoffs over our transfer agent
(no vLLM import; ``connector.py`` drives it from vLLM's hooks on vLLM's engine thread).

It runs in vLLM's worker (inside vLLM's engine-core process, where the KV tensors are), with a
:class:`~dynamo.backend.kv_transfer.KVTransferAgent` of its own on a private event loop in a
daemon thread, so that neither serving nor pulling ever waits on vLLM's step loop, nor the step
loop on the network:

- prefill side: a finished prompt's blocks are *held* under the request id (vLLM keeps them
  allocated: ``request_finished`` returned ``delay_free``); the decode side's pull names that id
  (the handoff's handle), gets the bytes, and the request is reported *sent* so vLLM frees the
  blocks. A pull of no block still ends the handoff (the decode side had the prompt cached). A
  handoff nobody pulls within ``hold_timeout_s`` is dropped (its client went away).
- decode side: a *load* pulls the prompt's blocks from the prefill worker's agent and writes
  them into the blocks vLLM allocated for them, then reports the request *received* (vLLM then
  schedules it with those tokens computed) or *failed* (vLLM fails the request: the
  connector's ``kv_load_failure_policy`` is ``fail``; our engine turns that into
  ``KVTransferFailed``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from dynamo.backend.kv_transfer import ExportedBlocks, KVTransferAgent, TransferStats
from dynamo.runtime.errors import InvalidArgument
from dynamo.vllm.paged_kv import PagedKV

log = logging.getLogger(__name__)

HOLD_TIMEOUT_S = 60.0
"""How long a prefill worker keeps a finished prompt's blocks for a decode worker's pull."""
EARLY_PULL_WAIT_S = 10.0
"""A pull may come before vLLM's next step has told this worker what to hold: it waits so long
(a pull of a handoff that already ended is refused at once)."""
_ENDED_KEPT = 4096


@dataclass(frozen=True, slots=True)
class Load:
    """Pull ``remote_ids`` of the handoff ``handle`` from ``host:port`` into ``local_ids``
    (as many; empty: only end the handoff)."""

    host: str
    port: int
    handle: str
    remote_ids: list[int]
    local_ids: list[int]


@dataclass(slots=True)
class _Held:
    block_ids: list[int]
    deadline: float


@dataclass(slots=True)
class _Done:
    """Finished transfers not yet reported to vLLM (guarded by the worker's lock)."""

    sent: set[str] = field(default_factory=set)
    received: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)


class HandoffWorker:
    """One per vLLM worker. ``start`` binds the agent and returns its port; ``hold``, ``load``
    and ``take_finished`` are called from vLLM's engine thread."""

    def __init__(
        self,
        kv: PagedKV,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        hold_timeout_s: float = HOLD_TIMEOUT_S,
    ) -> None:
        self.kv = kv
        self.host = host
        self.hold_timeout_s = hold_timeout_s
        self._agent = KVTransferAgent(None, None, host=host, port=port)
        self._agent.serve_handles(self._export)
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}
        self._ended: deque[str] = deque(maxlen=_ENDED_KEPT)
        self._done = _Done()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="dynamo-kv", daemon=True
        )
        self._held_changed: asyncio.Condition | None = None
        self.port = 0

    @property
    def stats(self) -> TransferStats:
        """The agent's running totals: pulls served (handoffs sent) and pulls made (loads),
        bytes each way, seconds receiving. Written on the agent's loop; read from any thread."""
        return self._agent.stats

    def start(self) -> int:
        self._thread.start()
        self.port = self._call(self._listen())
        return self.port

    async def _listen(self) -> int:
        self._held_changed = asyncio.Condition()
        return await self._agent.listen()

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        self._call(self._agent.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    # -- engine thread -------------------------------------------------------------------------
    def hold(self, request_id: str, block_ids: list[int]) -> None:
        """Keep ``block_ids`` for the decode side's pull of ``request_id``."""
        with self._lock:
            self._held[request_id] = _Held(block_ids, time.monotonic() + self.hold_timeout_s)
        self._loop.call_soon_threadsafe(self._notify_held)

    def load(self, request_id: str, load: Load) -> None:
        """Start pulling ``load`` for ``request_id``; its end shows in :meth:`take_finished`
        (a load of no block is not reported: no request waits on it)."""
        asyncio.run_coroutine_threadsafe(self._load(request_id, load), self._loop)

    def take_finished(self) -> tuple[set[str], set[str], set[str]]:
        """(sent, received, failed) since the last call; ``failed`` ids are also in
        ``received`` (vLLM's contract). Drops the handoffs held past their deadline."""
        now = time.monotonic()
        with self._lock:
            expired = [rid for rid, h in self._held.items() if h.deadline <= now]
            for rid in expired:
                del self._held[rid]
                self._ended.append(rid)
            done, self._done = self._done, _Done()
        if expired:
            log.warning("KV handoffs never pulled, blocks freed: %s", expired)
        return done.sent | set(expired), done.received, done.failed

    # -- agent loop ----------------------------------------------------------------------------
    def _call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    def _notify_held(self) -> None:
        cond = self._held_changed
        if cond is not None:
            asyncio.ensure_future(self._wake(cond))

    @staticmethod
    async def _wake(cond: asyncio.Condition) -> None:
        async with cond:
            cond.notify_all()

    async def _export(self, handle: str, block_ids: list[int]) -> ExportedBlocks:
        """Serve a pull: the asked blocks of the held handoff ``handle``, which then ends."""
        cond = self._held_changed
        assert cond is not None
        async with cond:
            try:
                await asyncio.wait_for(cond.wait_for(lambda: self._has(handle)), EARLY_PULL_WAIT_S)
            except TimeoutError:
                raise InvalidArgument(f"no KV handoff {handle!r} here") from None
        with self._lock:
            held = self._held.pop(handle)
        missing = set(block_ids) - set(held.block_ids)
        if missing:
            with self._lock:  # a bad pull does not end the handoff
                self._held.setdefault(handle, held)
            raise InvalidArgument(f"blocks {sorted(missing)[:4]} are not in handoff {handle!r}")
        data = self.kv.export(block_ids)  # a copy: the blocks may be freed from here on
        with self._lock:
            self._ended.append(handle)
            self._done.sent.add(handle)
        return ExportedBlocks(self.kv.layout, block_ids, [], data)

    def _has(self, handle: str) -> bool:
        """Held now (True), or ended already (raises): the waiting pull stops either way."""
        with self._lock:
            if handle in self._held:
                return True
            if handle in self._ended:
                raise InvalidArgument(f"KV handoff {handle!r} has ended")
            return False

    async def _load(self, request_id: str, load: Load) -> None:
        try:
            got = await self._agent.pull_from(
                load.host, load.port, load.remote_ids, handle=load.handle
            )
            if got.block_hashes != load.remote_ids:
                raise ValueError(f"asked blocks {load.remote_ids}, got {got.block_hashes}")
            self.kv.load(load.local_ids, got.data, got.layout)
        except Exception as exc:  # noqa: BLE001 - any failure fails this request only
            log.warning(
                "KV load of %s from %s:%d failed: %s", request_id, load.host, load.port, exc
            )
            if load.local_ids:
                with self._lock:
                    self._done.failed.add(request_id)
                    self._done.received.add(request_id)
            return
        if load.local_ids:
            with self._lock:
                self._done.received.add(request_id)
