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

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class KVLayout(msgspec.Struct, frozen=True, kw_only=True):
    """Shape of the exported bytes. Import requires an identical layout (same model and
    block size; the dtype names a torch dtype: ``float32``, ``bfloat16``, ``float16``)."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str


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
        """The K/V bytes of ``slots``, in the module docstring's order."""
        index = torch.tensor(slots, dtype=torch.int64, device=self.pools[0][0].device)
        # [kv_heads, n, block_size, head_dim] -> block-major [n, block_size, kv_heads, head_dim]
        parts = [t.index_select(1, index).permute(1, 2, 0, 3) for pair in self.pools for t in pair]
        flat = torch.cat([p.reshape(-1) for p in parts]).cpu().view(torch.uint8).clone()
        return bytes(flat.untyped_storage())  # a fresh tensor: its storage is exactly it

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
