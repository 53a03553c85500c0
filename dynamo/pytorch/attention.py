"""Paged attention on plain torch ops: K/V live in a block pool, each sequence reads its own
blocks through its block table.

Pool layout (per layer, one for K and one for V), head-major::

    pool[kv_heads, num_blocks, block_size, head_dim]
    token at position p of a sequence  ->  pool[:, table[p // block_size], p % block_size]

Head-major, so that gathering a sequence's blocks (``index_select`` on dim 1) directly gives
the ``[kv_heads, keys, head_dim]`` operand attention wants, with no transpose copy.

Choice (CPU first, measured in docs/performance.md): all *decode* rows at once (their blocks
gathered into a padded ``[kv_heads, B, max_ctx]`` tensor, padding masked by an additive bias,
batched matmuls per (KV head, row), the query heads of a group sharing their K/V), and one SDPA
call per *prefill* chunk (many queries per call, SDPA's causal kernel). Measured at 32 decode
rows x 192 keys: SDPA with a mask spent most of its time in per-(row, head) work; advanced
indexing gathered ~3x slower than ``index_select``; the token-major pool needed a transpose
copy of every gathered K/V. Writing all new K/V of a layer before any read makes a prefix
computed earlier in the same pass visible to every sequence that shares it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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
    decode_rows: torch.Tensor | None
    """Rows of the decode entries (one query each), in ``decode_tables`` order."""
    decode_tables: torch.Tensor | None
    """``[B, max_blocks]`` block tables of the decode rows, padded with block 0."""
    decode_bias: torch.Tensor | None
    """``[1, B, 1, max_blocks * block_size]`` float32: 0 where a key exists, -inf on padding."""


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
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention of the rows' queries ``q [T, heads, head_dim]`` over their sequences' cached
    K/V (already written for this pass). Returns ``[T, heads, head_dim]``."""
    out = torch.empty_like(q)
    kv_heads, head_dim = k_pool.shape[0], k_pool.shape[3]
    gqa = q.shape[1] != kv_heads
    for span in meta.prefills:
        rows = slice(span.start, span.start + span.num_queries)
        n = span.context_len
        k = k_pool.index_select(1, span.block_table).view(kv_heads, -1, head_dim)[:, :n]
        v = v_pool.index_select(1, span.block_table).view(kv_heads, -1, head_dim)[:, :n]
        o = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1).unsqueeze(0),
            k.unsqueeze(0),
            v.unsqueeze(0),
            attn_mask=span.mask,
            is_causal=span.mask is None,
            scale=scale,
            enable_gqa=gqa,
        )
        out[rows] = o.squeeze(0).transpose(0, 1)
    if meta.decode_rows is not None:
        out.index_copy_(0, meta.decode_rows, _decode_attention(q, k_pool, v_pool, meta, scale))
    return out


def _decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """One query per row over its padded, masked context: ``[B, heads, head_dim]``."""
    rows, tables, bias = meta.decode_rows, meta.decode_tables, meta.decode_bias
    assert rows is not None and tables is not None and bias is not None
    b = tables.shape[0]
    kv_heads, head_dim = k_pool.shape[0], k_pool.shape[3]
    group = q.shape[1] // kv_heads
    flat = tables.reshape(-1)
    # [kv_heads * B, keys, head_dim]: contiguous straight out of the gather.
    k = k_pool.index_select(1, flat).view(kv_heads * b, -1, head_dim)
    v = v_pool.index_select(1, flat).view(kv_heads * b, -1, head_dim)
    qg = q.index_select(0, rows).view(b, kv_heads, group, head_dim).transpose(0, 1)
    qg = qg.reshape(kv_heads * b, group, head_dim)
    full_bias = bias.expand(kv_heads, b, group, -1).reshape(kv_heads * b, group, -1)
    scores = torch.baddbmm(full_bias.to(q.dtype), qg, k.transpose(1, 2), alpha=scale)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    o = torch.bmm(probs, v).view(kv_heads, b, group, head_dim).transpose(0, 1)
    return o.reshape(b, kv_heads * group, head_dim)
