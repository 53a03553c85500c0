"""Paged attention on plain torch ops: K/V live in a block pool, each sequence reads its own
blocks through its block table.

Pool layout (per layer, one for K and one for V), head-major::

    pool[kv_heads, num_blocks, block_size, head_dim]
    token at position p of a sequence  ->  pool[:, table[p // block_size], p % block_size]

Head-major, so that gathering a sequence's blocks (``index_select`` on dim 1) directly gives
the ``[kv_heads, keys, head_dim]`` operand attention wants, with no transpose copy.

Choice (CPU first, measured in docs/performance.md): one SDPA call per *prefill* chunk (many
queries per call, SDPA's causal kernel; a chunk with no cached context attends over the K/V the
pass just computed, without reading them back from the pool), and all *decode* rows at once.
Decode on CPU float32 runs the C kernel ``dynamo.pytorch._paged_attn``, which reads each row's
blocks in place (no gather, no padding; the GIL is released). Elsewhere (another dtype or
device, the kernel not built, ``DYN_NATIVE=0``) decode runs on torch ops: the rows' blocks
gathered into a padded ``[kv_heads, B, max_ctx]`` tensor, padding masked by an additive bias,
batched matmuls per (KV head, row), the query heads of a group sharing their K/V. Writing all
new K/V of a layer before any read makes a prefix computed earlier in the same pass visible to
every sequence that shares it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dynamo import native

_KERNEL = native.load_optional("dynamo.pytorch._paged_attn")


def native_decode(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether decode rows of pools of ``dtype`` on ``device`` run the C kernel."""
    return _KERNEL is not None and dtype == torch.float32 and device.type == "cpu"


@dataclass(slots=True)
class PrefillSpan:
    """One prefill chunk: rows ``[start, start + num_queries)`` of the batch, whose last query
    sits at position ``context_len - 1``; ``block_table`` covers ``context_len`` tokens."""

    start: int
    num_queries: int
    context_len: int
    block_table: torch.Tensor
    mask: torch.Tensor | None
    """Causal mask ``[num_queries, context_len]`` (None: no cached prefix, plain causal)."""


@dataclass(slots=True)
class AttentionMetadata:
    """How the rows of one pass map onto the pool. Built once per pass, shared by all layers."""

    write_slots: torch.Tensor
    """Flat pool index (block * block_size + offset) of each row whose K/V is written."""
    write_rows: torch.Tensor | None
    """The rows written, when not all of them (a recomputed token of a cached block)."""
    prefills: list[PrefillSpan]
    decode: DecodeRows | None


@dataclass(slots=True)
class DecodeRows:
    """The decode entries of a pass (one query each), built by ``decode_rows``."""

    rows: torch.Tensor
    """``[B]`` int64: their rows in the batch."""
    tables: torch.Tensor
    """``[B, max_blocks]`` int64 block tables, padded with block 0."""
    lens: torch.Tensor
    """``[B]`` int64: keys per row (the row's own position + 1)."""
    bias: torch.Tensor | None
    """Torch path only: ``[kv_heads * B, group, max_blocks * block_size]`` float, 0 where a key
    exists and -inf on padding (KV-head-major, as the gathered K/V); None for the kernel."""


def decode_rows(
    rows: list[int],
    tables: list[list[int]],
    lens: list[int],
    *,
    block_size: int,
    kv_heads: int,
    group: int,
    dtype: torch.dtype,
    device: torch.device,
) -> DecodeRows:
    """The decode metadata of a pass, for the path ``native_decode`` picks for ``dtype`` and
    ``device`` (the pools' dtype and device)."""
    width = max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) for t in tables]
    out = DecodeRows(
        rows=torch.tensor(rows, dtype=torch.int64, device=device),
        tables=torch.tensor(padded, dtype=torch.int64, device=device),
        lens=torch.tensor(lens, dtype=torch.int64, device=device),
        bias=None,
    )
    if not native_decode(dtype, device):
        keys = torch.arange(width * block_size, device=device).unsqueeze(0)
        bias = torch.zeros(len(rows), width * block_size, dtype=dtype, device=device)
        bias.masked_fill_(keys >= out.lens.unsqueeze(1), float("-inf"))
        out.bias = bias.expand(kv_heads, group, -1, -1).transpose(1, 2)
        out.bias = out.bias.reshape(kv_heads * len(rows), group, width * block_size)
    return out


def write_kv(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
) -> None:
    """Store the rows' new K and V (``[T, kv_heads, head_dim]``) into their slots."""
    if meta.write_rows is not None:
        k, v = k.index_select(0, meta.write_rows), v.index_select(0, meta.write_rows)
    kv_heads, head_dim = k_pool.shape[0], k_pool.shape[3]
    k_pool.view(kv_heads, -1, head_dim).index_copy_(1, meta.write_slots, k.transpose(0, 1))
    v_pool.view(kv_heads, -1, head_dim).index_copy_(1, meta.write_slots, v.transpose(0, 1))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention of the rows' queries ``q [T, heads, head_dim]`` over their sequences' cached
    K/V (already written for this pass; ``k`` and ``v`` ``[T, kv_heads, head_dim]`` are the
    pass's new ones). Returns ``[T, heads, head_dim]``, contiguous."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    kv_heads, head_dim = k_pool.shape[0], k_pool.shape[3]
    gqa = q.shape[1] != kv_heads
    for span in meta.prefills:
        rows = slice(span.start, span.start + span.num_queries)
        n = span.context_len
        if n == span.num_queries:  # no cached context: all its K/V are this pass's rows
            ks, vs = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
        else:
            ks = k_pool.index_select(1, span.block_table).view(kv_heads, -1, head_dim)[:, :n]
            vs = v_pool.index_select(1, span.block_table).view(kv_heads, -1, head_dim)[:, :n]
        o = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1).unsqueeze(0),
            ks.unsqueeze(0),
            vs.unsqueeze(0),
            attn_mask=span.mask,
            is_causal=span.mask is None,
            scale=scale,
            enable_gqa=gqa,
        )
        out[rows] = o.squeeze(0).transpose(0, 1)
    decode = meta.decode
    if decode is not None:
        if decode.bias is None:
            _native_decode(q, out, k_pool, v_pool, decode, scale)
        else:
            out.index_copy_(0, decode.rows, _torch_decode(q, k_pool, v_pool, decode, scale))
    return out


def _native_decode(
    q: torch.Tensor,
    out: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    decode: DecodeRows,
    scale: float,
) -> None:
    """The C kernel writes the decode rows of ``out`` (checks: its module comment's layout)."""
    assert _KERNEL is not None
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads, num_blocks, block_size = k_pool.shape[0], k_pool.shape[1], k_pool.shape[2]
    for t in (k_pool, v_pool, decode.rows, decode.tables, decode.lens, out):
        assert t.is_contiguous()
    assert q.stride(2) == 1 and q.stride(1) == head_dim and out.shape == q.shape
    assert q.dtype == out.dtype == k_pool.dtype == v_pool.dtype == torch.float32
    _KERNEL.decode(
        q.data_ptr(),
        out.data_ptr(),
        k_pool.data_ptr(),
        v_pool.data_ptr(),
        decode.rows.data_ptr(),
        decode.tables.data_ptr(),
        decode.lens.data_ptr(),
        decode.rows.shape[0],
        q.shape[0],
        heads,
        kv_heads,
        head_dim,
        num_blocks,
        block_size,
        decode.tables.shape[1],
        q.stride(0),
        out.stride(0),
        scale,
    )


def _torch_decode(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    decode: DecodeRows,
    scale: float,
) -> torch.Tensor:
    """One query per row over its padded, masked context: ``[B, heads, head_dim]``."""
    tables, bias = decode.tables, decode.bias
    assert bias is not None
    b = tables.shape[0]
    kv_heads, head_dim = k_pool.shape[0], k_pool.shape[3]
    group = q.shape[1] // kv_heads
    flat = tables.reshape(-1)
    # [kv_heads * B, keys, head_dim]: contiguous straight out of the gather.
    k = k_pool.index_select(1, flat).view(kv_heads * b, -1, head_dim)
    v = v_pool.index_select(1, flat).view(kv_heads * b, -1, head_dim)
    qg = q.index_select(0, decode.rows).view(b, kv_heads, group, head_dim).transpose(0, 1)
    qg = qg.reshape(kv_heads * b, group, head_dim)
    scores = torch.baddbmm(bias, qg, k.transpose(1, 2), alpha=scale)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    o = torch.bmm(probs, v).view(kv_heads, b, group, head_dim).transpose(0, 1)
    return o.reshape(b, kv_heads * group, head_dim)
