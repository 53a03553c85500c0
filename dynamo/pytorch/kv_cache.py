"""The KV block pool tensors, and the export / import of blocks (disaggregation's payload).

One K and one V tensor per layer, ``[kv_heads, num_blocks, block_size, head_dim]`` (head-major:
see ``attention``); the slot numbers of ``dynamo.engine_core.KVManager`` index dimension 1.

Export format: ``KVBlocks`` = a ``KVLayout`` (what the bytes mean) + the blocks' sequence
hashes + the bytes, laid out as::

    for layer in range(num_layers):
        K[layer][blocks]   # [num_blocks, block_size, kv_heads, head_dim], C order
        V[layer][blocks]
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import torch

from dynamo.router.hashing import local_block_hashes, sequence_hashes

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class KVLayout(msgspec.Struct, frozen=True, kw_only=True):
    """Shape of the exported bytes. Import requires an identical layout (same model and
    block size; the dtype names a torch dtype: ``float32``, ``bfloat16``, ``float16``);
    :func:`convert_blocks` re-lays another one.

    Tensor parallelism splits the KV heads: a pool (one rank's) holds the ``num_kv_heads``
    heads ``[head_start, head_start + num_kv_heads)`` of the model's ``total_kv_heads``
    (0: all of them, the TP=1 pool of this engine)."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    head_start: int = 0
    total_kv_heads: int = 0

    @property
    def model_kv_heads(self) -> int:
        return self.total_kv_heads or self.num_kv_heads

    @property
    def head_stop(self) -> int:
        return self.head_start + self.num_kv_heads


class KVBlocks(msgspec.Struct, frozen=True, kw_only=True):
    """A run of leading blocks of one sequence: ``block_hashes[i]`` (FACTS §1.2 sequence hash)
    and ``local_hashes[i]`` (§1.1) name block i; ``data`` holds their K/V."""

    layout: KVLayout
    block_hashes: list[int]
    local_hashes: list[int]
    data: bytes


@dataclass(slots=True)
class KVCache:
    """The pools of one engine. Accessed only from the engine's step thread."""

    layout: KVLayout
    num_blocks: int
    pools: list[tuple[torch.Tensor, torch.Tensor]]

    @classmethod
    def allocate(cls, layout: KVLayout, num_blocks: int, device: torch.device) -> KVCache:
        dtype = _DTYPES[layout.dtype]
        shape = (layout.num_kv_heads, num_blocks, layout.block_size, layout.head_dim)
        pools = [
            (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
            for _ in range(layout.num_layers)
        ]
        return cls(layout, num_blocks, pools)

    def export_slots(self, slots: list[int]) -> bytes:
        """The K/V bytes of ``slots``, in the module docstring's order. Runs of consecutive slots
        are copied as one slice each (one large copy instead of one gather per block)."""
        runs = contiguous_runs(slots)
        parts: list[torch.Tensor] = []
        for pair in self.pools:
            for t in pair:
                # [kv_heads, n, block_size, head_dim] -> block-major [n, block_size, heads, dim]
                pieces = [t.narrow(1, start, length) for start, length in runs]
                picked = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)
                parts.append(picked.permute(1, 2, 0, 3).reshape(-1))
        # bytes(storage) walks it element by element (seconds per MiB); numpy copies at memcpy
        # speed (bfloat16 has no numpy dtype: the uint8 view does)
        return torch.cat(parts).cpu().view(torch.uint8).numpy().tobytes()

    def import_slots(self, slots: list[int], data: bytes) -> None:
        """Write bytes from ``export_slots`` (same layout) into ``slots``."""
        dtype = _DTYPES[self.layout.dtype]
        lay = self.layout
        per_block = lay.block_size * lay.num_kv_heads * lay.head_dim
        expected = len(slots) * per_block * 2 * lay.num_layers * torch.finfo(dtype).bits // 8
        if len(data) != expected:
            raise ValueError(f"KV payload has {len(data)} bytes, the layout needs {expected}")
        device = self.pools[0][0].device
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).to(device)
        shape = (len(slots), lay.block_size, lay.num_kv_heads, lay.head_dim)
        index = torch.tensor(slots, dtype=torch.int64, device=device)
        chunk = len(slots) * per_block
        for i, t in enumerate(t for pair in self.pools for t in pair):
            blocks = flat[i * chunk : (i + 1) * chunk].view(shape).permute(2, 0, 1, 3)
            t.index_copy_(1, index, blocks)


def contiguous_runs(slots: list[int]) -> list[tuple[int, int]]:
    """``slots`` as (start, length) runs of consecutive ids, in order."""
    runs: list[tuple[int, int]] = []
    for slot in slots:
        if runs and runs[-1][0] + runs[-1][1] == slot:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((slot, 1))
    return runs


def _sections(blocks: KVBlocks) -> torch.Tensor:
    """The bytes of ``blocks`` as ``[2 * layers, tokens, heads, head_dim]`` (a view)."""
    src = blocks.layout
    tokens = len(blocks.block_hashes) * src.block_size
    flat = torch.frombuffer(bytearray(blocks.data), dtype=torch.uint8).view(_DTYPES[src.dtype])
    return flat.view(2 * src.num_layers, tokens, src.num_kv_heads, src.head_dim)


def _to_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()


def merge_head_shards(parts: list[KVBlocks]) -> KVBlocks:
    """One run of blocks from the head shards of a tensor-parallel pool (each rank's export of
    the same blocks): the heads side by side, in head order. The shards must be contiguous in
    heads and agree on everything else; the common leading run of blocks is kept (a rank may
    have evicted more)."""
    if not parts:
        raise ValueError("no KV head shards to merge")
    parts = sorted(parts, key=lambda p: p.layout.head_start)
    first = parts[0].layout
    n = min(len(p.block_hashes) for p in parts)
    stop = first.head_start
    for p in parts:
        lay = p.layout
        same = (lay.num_layers, lay.block_size, lay.head_dim, lay.dtype, lay.model_kv_heads)
        if same != (
            first.num_layers,
            first.block_size,
            first.head_dim,
            first.dtype,
            first.model_kv_heads,
        ):
            raise ValueError(f"KV head shards {first} and {lay} are not of one pool")
        if lay.head_start != stop:
            raise ValueError(f"KV head shards leave a gap or overlap at head {stop}")
        if p.block_hashes[:n] != parts[0].block_hashes[:n]:
            raise ValueError("KV head shards hold different blocks")
        stop = lay.head_stop
    tokens = n * first.block_size
    merged = torch.cat([_sections(p)[:, :tokens] for p in parts], dim=2)
    layout = msgspec.structs.replace(first, num_kv_heads=stop - first.head_start)
    if layout.head_start == 0 and stop == layout.model_kv_heads:
        layout = msgspec.structs.replace(layout, total_kv_heads=0)  # the whole pool
    return KVBlocks(
        layout=layout,
        block_hashes=parts[0].block_hashes[:n],
        local_hashes=parts[0].local_hashes[:n],
        data=_to_bytes(merged),
    )


def convert_blocks(blocks: KVBlocks, layout: KVLayout, token_ids: list[int]) -> KVBlocks:
    """``blocks`` re-laid for an engine of ``layout`` (the same model: layers, the model's KV
    heads and head size agree; block size, dtype and the head range may differ). The exported
    bytes are token-major within each (layer, K/V) section, so another block size only
    regroups the same tokens: the result holds the whole blocks of ``layout.block_size`` that
    the received tokens cover, named by hashes of ``token_ids`` (the prompt those blocks hold)
    at that block size. Another tensor-parallel split: the source's heads must cover
    ``layout``'s, which are cut out (merge the shards of a split source first:
    :func:`merge_head_shards`)."""
    src = blocks.layout
    if (src.num_layers, src.model_kv_heads, src.head_dim) != (
        layout.num_layers,
        layout.model_kv_heads,
        layout.head_dim,
    ):
        raise ValueError(f"KV layout {src} cannot be converted to {layout} (another model?)")
    if not src.head_start <= layout.head_start < layout.head_stop <= src.head_stop:
        raise ValueError(
            f"KV heads [{src.head_start}, {src.head_stop}) do not cover the "
            f"[{layout.head_start}, {layout.head_stop}) this pool holds"
        )
    tokens = len(blocks.block_hashes) * src.block_size
    if tokens > len(token_ids):
        raise ValueError("the received KV covers more tokens than the prompt has")
    n = tokens // layout.block_size
    heads = slice(layout.head_start - src.head_start, layout.head_stop - src.head_start)
    kept = _sections(blocks)[:, : n * layout.block_size, heads].to(_DTYPES[layout.dtype])
    data = _to_bytes(kept)
    local = local_block_hashes(token_ids[: n * layout.block_size], layout.block_size)
    return KVBlocks(
        layout=layout, block_hashes=sequence_hashes(local), local_hashes=local, data=data
    )


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported KV dtype {dtype}")


def blocks_for_memory(layout: KVLayout, memory_bytes: int) -> int:
    """How many blocks ``memory_bytes`` of KV cache hold."""
    dtype_bytes = torch.finfo(_DTYPES[layout.dtype]).bits // 8
    per_block = 2 * layout.num_layers * layout.block_size * layout.num_kv_heads * layout.head_dim
    return memory_bytes // (per_block * dtype_bytes)
