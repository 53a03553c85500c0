"""vLLM's paged KV cache tensors as bytes, block by block (the disaggregation connector's
tensor side; no vLLM import).

vLLM gives a KV connector its caches as ``{layer_name: tensor}``; each tensor has one axis of
``num_blocks`` (axis 0 on the CPU backend: ``[blocks, kv_heads, block_size * 2, head_dim]``
viewed; axis 1 where K and V come first, as on CUDA's flash attention). Exported bytes are, layer
after layer in name order, the chosen blocks of that layer's tensor along its block axis,
contiguous. Both sides of a handoff run the same model with the same engine flags, so the
layout must match exactly (``layout``): another one is refused, not converted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class LayoutMismatch(ValueError):
    """The peer's KV layout differs from ours (another model, dtype or block size)."""


@dataclass(slots=True)
class PagedKV:
    """``caches``: vLLM's registered tensors; ``num_blocks``: the pool's block count (finds
    each tensor's block axis); ``block_size``: tokens per block."""

    caches: dict[str, torch.Tensor]
    num_blocks: int
    block_size: int
    _names: list[str] = field(init=False)
    _axes: list[int] = field(init=False)

    def __post_init__(self) -> None:
        if not self.caches:
            raise ValueError("vLLM registered no KV cache tensor")
        self._names = sorted(self.caches)
        self._axes = [_block_axis(self.caches[n], self.num_blocks, n) for n in self._names]

    @property
    def layout(self) -> dict[str, object]:
        """What a peer must match to read our bytes (msgpack-able)."""
        shapes = []
        for name, axis in zip(self._names, self._axes, strict=True):
            shape = list(self.caches[name].shape)
            del shape[axis]
            shapes.append([axis, *shape])
        first = self.caches[self._names[0]]
        return {
            "engine": "vllm",
            "block_size": self.block_size,
            "dtype": str(first.dtype).removeprefix("torch."),
            "layers": shapes,
        }

    @property
    def bytes_per_block(self) -> int:
        return sum(
            t.numel() // t.shape[axis] * t.element_size()
            for t, axis in zip(self._tensors(), self._axes, strict=True)
        )

    def export(self, block_ids: list[int]) -> bytes:
        """The bytes of ``block_ids`` (in that order), every layer."""
        self._check_ids(block_ids)
        if not block_ids:
            return b""
        index = torch.tensor(block_ids, dtype=torch.long)
        parts = [
            t.index_select(axis, index).contiguous().view(torch.uint8).reshape(-1)
            for t, axis in zip(self._tensors(), self._axes, strict=True)
        ]
        return torch.cat(parts).numpy().tobytes()

    def load(self, block_ids: list[int], data: bytes, layout: dict[str, object]) -> None:
        """Write ``data`` (a peer's :meth:`export` of as many blocks, in ``layout``) into our
        ``block_ids``. ``LayoutMismatch`` / ``ValueError`` before anything is written."""
        if layout != self.layout:
            raise LayoutMismatch(f"peer KV layout {layout} is not ours ({self.layout})")
        self._check_ids(block_ids)
        if len(data) != len(block_ids) * self.bytes_per_block:
            raise ValueError(
                f"{len(data)} bytes for {len(block_ids)} blocks of {self.bytes_per_block}"
            )
        if not block_ids:
            return
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        index = torch.tensor(block_ids, dtype=torch.long)
        offset = 0
        for t, axis in zip(self._tensors(), self._axes, strict=True):
            shape = list(t.shape)
            shape[axis] = len(block_ids)
            size = len(block_ids) * (t.numel() // t.shape[axis]) * t.element_size()
            chunk = raw[offset : offset + size].view(t.dtype).reshape(shape)
            t.index_copy_(axis, index, chunk)
            offset += size

    def _tensors(self) -> list[torch.Tensor]:
        return [self.caches[n] for n in self._names]

    def _check_ids(self, block_ids: list[int]) -> None:
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"block ids {bad[:4]} out of [0, {self.num_blocks})")


def _block_axis(tensor: torch.Tensor, num_blocks: int, name: str) -> int:
    for axis in (0, 1):
        if tensor.dim() > axis and tensor.shape[axis] == num_blocks:
            return axis
    raise ValueError(f"KV cache {name} {tuple(tensor.shape)} has no axis of {num_blocks} blocks")
