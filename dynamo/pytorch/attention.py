"""Paged attention on plain torch ops: K/V live in a block pool, each sequence reads its own
blocks through its block table.

Pool layout (per layer, one for K and one for V)::

    pool[num_blocks, block_size, kv_heads, head_dim]
    token at position p of a sequence  ->  pool[table[p // block_size], p % block_size]

Choice (CPU first, measured in docs/performance.md): one batched SDPA call for all *decode*
rows (their blocks gathered block-wise into a padded ``[B, max_ctx]`` tensor and masked by
length), and one SDPA call per *prefill* chunk (a chunk has many queries, so the per-call
overhead is paid back). A token-wise gather (one index per token) costs several times more than
the block-wise one; a fully padded batch of mixed prefill and decode wastes work on padding.
Writing all new K/V of a layer before any read makes a prefix computed earlier in the same pass
visible to every sequence that shares it.
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
    decode_mask: torch.Tensor | None
    """``[B, 1, 1, max_blocks * block_size]``: True where a key exists."""


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
    kv_heads, head_dim = k_pool.shape[2], k_pool.shape[3]
    k_pool.view(-1, kv_heads, head_dim).index_copy_(0, meta.write_slots, k)
    v_pool.view(-1, kv_heads, head_dim).index_copy_(0, meta.write_slots, v)


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
    kv_heads, head_dim = k_pool.shape[2], k_pool.shape[3]
    gqa = q.shape[1] != kv_heads
    for span in meta.prefills:
        rows = slice(span.start, span.start + span.num_queries)
        k = k_pool[span.block_table].view(-1, kv_heads, head_dim)[: span.context_len]
        v = v_pool[span.block_table].view(-1, kv_heads, head_dim)[: span.context_len]
        o = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=span.mask,
            is_causal=span.mask is None,
            scale=scale,
            enable_gqa=gqa,
        )
        out[rows] = o.squeeze(0).transpose(0, 1)
    if meta.decode_rows is not None:
        assert meta.decode_tables is not None and meta.decode_mask is not None
        b = meta.decode_tables.shape[0]
        k = k_pool[meta.decode_tables].view(b, -1, kv_heads, head_dim).transpose(1, 2)
        v = v_pool[meta.decode_tables].view(b, -1, kv_heads, head_dim).transpose(1, 2)
        qd = q.index_select(0, meta.decode_rows).unsqueeze(2)  # [B, heads, 1, head_dim]
        o = F.scaled_dot_product_attention(
            qd, k, v, attn_mask=meta.decode_mask, scale=scale, enable_gqa=gqa
        )
        out.index_copy_(0, meta.decode_rows, o.squeeze(2))
    return out
