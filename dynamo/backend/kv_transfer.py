"""The KV transfer agent of a worker (spec 003): moves KV blocks directly between two workers,
never through the frontend.

Each worker that takes part in disaggregation runs one agent: a TCP server of its own (bound at
start, port 0 by default) whose *descriptor* (address, and the engine's KV layout) is published
in discovery at ``v1/kv_transfer/{namespace}/{instance_id:x}`` under the worker's lease, so it
vanishes with the worker. A decode worker receiving a handoff pulls the prompt's blocks from the
prefill worker named in it: only block ids (sequence hashes) travel with the request; the peer's
descriptor is loaded from discovery at the first pull from that peer and cached (dropped when a
connection to it fails, so a restarted peer is found again).

Wire, one pull per connection: the client sends a 4-byte big-endian length and a msgpack
:class:`PullRequest`; the server answers a 4-byte length and a msgpack :class:`PullHeader`,
then exactly ``nbytes`` raw bytes. The server is hardened like the request plane: a request
larger than ``MAX_REQUEST_BYTES`` or with more than ``MAX_BLOCKS`` ids is refused, a client that
does not send its request within ``REQUEST_TIMEOUT_S`` is dropped, at most ``MAX_CONNECTIONS``
pulls are served at once (the rest wait in the kernel backlog), and a pull must complete within
``TRANSFER_TIMEOUT_S`` on either side.

The agent knows nothing of tensors: the engine gives it an ``export`` coroutine (block ids -> the
leading run of those blocks it still caches, with their bytes) and reads what ``pull`` returns.

An engine whose blocks are held for a named handoff rather than found by hash (the vLLM
connector, ``dynamo/vllm/connector.py``: the prefill side holds a finished request's blocks until
its decode side has pulled them) serves with ``serve_handles``: each pull then names the handoff
(``PullRequest.handle``), and a pull of no block at all still tells the server that the handoff
is over. Such an agent may run without a runtime (inside vLLM's engine-core process): it only
listens (``listen``) and pulls by address (``pull_from``); its address travels with the handoff.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec

from dynamo.runtime.errors import CannotConnect, InvalidArgument, StreamIncomplete, Unknown
from dynamo.runtime.runtime import DistributedRuntime

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 4 << 20
MAX_BLOCKS = 1 << 17
MAX_HEADER_BYTES = 16 << 20
REQUEST_TIMEOUT_S = 10.0
TRANSFER_TIMEOUT_S = 60.0
MAX_CONNECTIONS = 32
_LEN = struct.Struct(">I")
_STREAM_LIMIT = 1 << 20


def descriptor_key(namespace: str, instance_id: int) -> str:
    return f"v1/kv_transfer/{namespace}/{instance_id:x}"


class ShardAddress(msgspec.Struct, frozen=True, kw_only=True):
    """One rank of a worker whose KV pool is split across ranks (tensor parallelism splits the
    KV heads): where that rank's agent listens and the layout of its share."""

    host: str
    port: int
    layout: dict[str, object]


class AgentDescriptor(msgspec.Struct, frozen=True, kw_only=True):
    """What a peer needs to pull from a worker: its agent's address and its KV layout (opaque to
    the agent: the engine's own layout struct, as msgpack-able data). A worker whose pool is
    split in shards lists them (``shards``): a pull then fetches every shard, and ``layout`` is
    the whole pool's."""

    host: str
    port: int
    layout: dict[str, object]
    num_blocks: int = 0
    shards: list[ShardAddress] = msgspec.field(default_factory=list)


async def publish_descriptor(
    runtime: DistributedRuntime, instance_id: int, descriptor: AgentDescriptor
) -> None:
    """Publish ``instance_id``'s descriptor under the runtime's lease (it leaves with it)."""
    key = descriptor_key(runtime.namespace, instance_id)
    await runtime.discovery.put(key, _encoder.encode(descriptor), runtime.lease)


class PullRequest(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """``block_hashes``: the blocks asked for (sequence hashes, or the serving engine's own block
    ids when ``handle`` names a handoff)."""

    block_hashes: list[int]
    handle: str | None = None


class PullHeader(msgspec.Struct, frozen=True, kw_only=True):
    """The answer to a pull: the leading run of the asked blocks still cached (maybe shorter,
    maybe empty), the layout of the bytes that follow, or an error."""

    layout: dict[str, object] | None = None
    block_hashes: list[int] = msgspec.field(default_factory=list)
    local_hashes: list[int] = msgspec.field(default_factory=list)
    nbytes: int = 0
    error: str | None = None


@dataclass(frozen=True, slots=True)
class ExportedBlocks:
    """Blocks as one side holds them: ``data`` in ``layout``'s byte order."""

    layout: dict[str, object]
    block_hashes: list[int]
    local_hashes: list[int]
    data: bytes


ExportFn = Callable[[list[int]], Awaitable[ExportedBlocks]]
# (handle, block ids) -> those blocks of that handoff; the handoff ends with the pull.
HandleExportFn = Callable[[str, list[int]], Awaitable[ExportedBlocks]]


@dataclass(slots=True)
class TransferStats:
    """Running totals, for the worker's metrics: blocks sent and received."""

    pulls_served: int = 0
    bytes_sent: int = 0
    pulls: int = 0
    bytes_received: int = 0
    seconds_receiving: float = 0.0


_request_decoder = msgspec.msgpack.Decoder(PullRequest)
_header_decoder = msgspec.msgpack.Decoder(PullHeader)
_descriptor_decoder = msgspec.msgpack.Decoder(AgentDescriptor)
_encoder = msgspec.msgpack.Encoder()


class KVTransferAgent:
    """One per engine instance. ``export`` (None: this worker only pulls) serves peers' pulls.
    Without a ``runtime`` the agent publishes nothing and finds no peer: ``listen`` and
    ``pull_from`` only."""

    def __init__(
        self,
        runtime: DistributedRuntime | None,
        export: ExportFn | None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self._runtime = runtime
        self._export = export
        self._export_handle: HandleExportFn | None = None
        self._host = host
        self._port = port
        self._server: asyncio.Server | None = None
        self._peers: dict[int, AgentDescriptor] = {}
        self._slots = asyncio.Semaphore(MAX_CONNECTIONS)
        self._handlers: set[asyncio.Task[None]] = set()
        self.stats = TransferStats()
        self.port = 0

    def serve(self, export: ExportFn) -> None:
        """Serve peers' pulls with ``export`` (set before :meth:`start`)."""
        self._export = export

    def serve_handles(self, export: HandleExportFn) -> None:
        """Serve pulls that name a handoff (``PullRequest.handle``) with ``export``."""
        self._export_handle = export

    async def listen(self) -> int:
        """Bind the server (``host``, ``port``; 0: a free port) and return its port."""
        self._server = await asyncio.start_server(
            self._accept, self._host, self._port, limit=_STREAM_LIMIT, backlog=256
        )
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def start(self, instance_id: int, layout: dict[str, object], num_blocks: int) -> None:
        """Listen and publish this worker's descriptor (under the runtime's lease)."""
        if self._runtime is None:
            raise RuntimeError("an agent without a runtime publishes no descriptor: listen()")
        await self.listen()
        descriptor = AgentDescriptor(
            host=self._host, port=self.port, layout=layout, num_blocks=num_blocks
        )
        await publish_descriptor(self._runtime, instance_id, descriptor)
        log.info("KV transfer agent of %x listening on %s:%d", instance_id, self._host, self.port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    # -- serving pulls -------------------------------------------------------------------------
    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            async with self._slots:
                await self._serve_one(reader, writer)
        except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
            log.debug("KV pull connection ended: %s", exc)
        finally:
            self._handlers.discard(task)
            writer.close()

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            (size,) = _LEN.unpack(await reader.readexactly(_LEN.size))
            if size > MAX_REQUEST_BYTES:
                await _send(writer, PullHeader(error=f"pull request of {size} bytes is too big"))
                return
            raw = await reader.readexactly(size)
        try:
            request = _request_decoder.decode(raw)
            if len(request.block_hashes) > MAX_BLOCKS:
                raise InvalidArgument(f"at most {MAX_BLOCKS} blocks per pull")
            if request.handle is not None:
                if self._export_handle is None:
                    raise InvalidArgument("this worker serves no KV handoffs")
                blocks = await self._export_handle(request.handle, request.block_hashes)
            elif self._export is None:
                raise InvalidArgument("this worker serves no KV blocks")
            else:
                blocks = await self._export(request.block_hashes)
        except Exception as exc:  # the peer gets the reason; the agent keeps serving
            await _send(writer, PullHeader(error=str(exc) or type(exc).__name__))
            return
        header = PullHeader(
            layout=blocks.layout,
            block_hashes=blocks.block_hashes,
            local_hashes=blocks.local_hashes,
            nbytes=len(blocks.data),
        )
        async with asyncio.timeout(TRANSFER_TIMEOUT_S):
            await _send(writer, header, blocks.data)
        self.stats.pulls_served += 1
        self.stats.bytes_sent += len(blocks.data)

    # -- pulling -----------------------------------------------------------------------------------
    async def peer(self, instance_id: int) -> AgentDescriptor:
        """The peer's descriptor: from the cache, else loaded from discovery (``CannotConnect``
        when the peer published none: gone, or not a transfer-capable worker)."""
        descriptor = self._peers.get(instance_id)
        if descriptor is None:
            if self._runtime is None:
                raise CannotConnect("an agent without a runtime finds no peer: pull_from()")
            key = descriptor_key(self._runtime.namespace, instance_id)
            kv = await self._runtime.discovery.get(key)
            if kv is None:
                raise CannotConnect(f"worker {instance_id:x} has no KV transfer agent")
            descriptor = self._peers[instance_id] = _descriptor_decoder.decode(kv.value)
        return descriptor

    async def pull(self, instance_id: int, block_hashes: list[int]) -> list[ExportedBlocks]:
        """The leading run of ``block_hashes`` that ``instance_id`` still caches, with their
        bytes: one answer, or one per shard (in the descriptor's order, pulled at once) from a
        worker whose pool is split. Raises ``CannotConnect`` (peer unreachable),
        ``StreamIncomplete`` (cut short or too slow) or ``Unknown`` (the peer refused)."""
        descriptor = await self.peer(instance_id)
        if not descriptor.shards:
            return [
                await self._pull_one(
                    instance_id, descriptor.host, descriptor.port, descriptor.layout, block_hashes
                )
            ]
        return list(
            await asyncio.gather(
                *(
                    self._pull_one(instance_id, s.host, s.port, s.layout, block_hashes)
                    for s in descriptor.shards
                )
            )
        )

    async def pull_from(
        self, host: str, port: int, block_ids: list[int], *, handle: str, peer_id: int = 0
    ) -> ExportedBlocks:
        """Pull ``block_ids`` of the handoff ``handle`` from the agent at ``host:port`` (the
        address came with the handoff); the same errors as :meth:`pull`."""
        return await self._pull_one(peer_id, host, port, {}, block_ids, handle=handle)

    async def _pull_one(
        self,
        instance_id: int,
        host: str,
        port: int,
        layout: dict[str, object],
        block_hashes: list[int],
        *,
        handle: str | None = None,
    ) -> ExportedBlocks:
        started = time.perf_counter()
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port, limit=_STREAM_LIMIT),
                REQUEST_TIMEOUT_S,
            )
        except (OSError, TimeoutError) as exc:
            self._peers.pop(instance_id, None)  # a restarted peer publishes a new address
            raise CannotConnect(f"KV transfer agent of {instance_id:x}: {exc}") from None
        try:
            async with asyncio.timeout(TRANSFER_TIMEOUT_S):
                await _send(writer, PullRequest(block_hashes=block_hashes, handle=handle))
                (size,) = _LEN.unpack(await reader.readexactly(_LEN.size))
                if size > MAX_HEADER_BYTES:
                    raise StreamIncomplete(f"KV pull header of {size} bytes is too big")
                header = _header_decoder.decode(await reader.readexactly(size))
                if header.error is not None:
                    raise Unknown(f"worker {instance_id:x} refused the KV pull: {header.error}")
                data = await reader.readexactly(header.nbytes)
        except (OSError, TimeoutError, asyncio.IncompleteReadError, msgspec.DecodeError) as exc:
            raise StreamIncomplete(f"KV pull from {instance_id:x} failed: {exc!r}") from None
        finally:
            writer.close()
        self.stats.pulls += 1
        self.stats.bytes_received += len(data)
        self.stats.seconds_receiving += time.perf_counter() - started
        if header.layout is not None:
            layout = header.layout
        return ExportedBlocks(layout, header.block_hashes, header.local_hashes, data)


async def _send(writer: asyncio.StreamWriter, message: msgspec.Struct, data: bytes = b"") -> None:
    body = _encoder.encode(message)
    writer.write(_LEN.pack(len(body)) + body)
    if data:
        writer.write(data)
    await writer.drain()
