"""dynamo/pytorch/attention.py: decode attention over the paged pool, on the C kernel and on torch
ops, against attention computed naively per row."""

from __future__ import annotations

import pytest
import torch

from dynamo.pytorch import attention
from dynamo.pytorch.attention import AttentionMetadata, decode_rows, paged_attention

BLOCK = 16
NUM_BLOCKS = 64
SCALE = 0.3


def _case(
    heads: int, kv_heads: int, head_dim: int, lens: list[int], seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    k_pool = torch.randn(kv_heads, NUM_BLOCKS, BLOCK, head_dim, generator=g)
    v_pool = torch.randn(kv_heads, NUM_BLOCKS, BLOCK, head_dim, generator=g)
    # 2 extra rows that are not decode rows (as prefill rows in a mixed pass)
    q = torch.randn(len(lens) + 2, heads, head_dim, generator=g)
    order = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    tables, used = [], 0
    for n in lens:
        count = -(-n // BLOCK)
        tables.append(order[used : used + count])
        used += count
    return q, k_pool, v_pool, tables


def _naive(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: list[int], n: int
) -> torch.Tensor:
    """One row: its keys in order, GQA by repetition, float64 softmax."""
    kv_heads, head_dim = k_pool.shape[0], k_pool.shape[3]
    k = k_pool[:, table].reshape(kv_heads, -1, head_dim)[:, :n].double()
    v = v_pool[:, table].reshape(kv_heads, -1, head_dim)[:, :n].double()
    group = q.shape[0] // kv_heads
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    probs = torch.softmax(torch.einsum("hd,hkd->hk", q.double(), k) * SCALE, dim=-1)
    return torch.einsum("hk,hkd->hd", probs, v).float()


def _run(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    tables: list[list[int]],
    lens: list[int],
    rows: list[int],
) -> torch.Tensor:
    heads, kv_heads = q.shape[1], k_pool.shape[0]
    meta = AttentionMetadata(
        write_slots=torch.empty(0, dtype=torch.int64),
        write_rows=None,
        prefills=[],
        decode=decode_rows(
            rows,
            tables,
            lens,
            block_size=BLOCK,
            kv_heads=kv_heads,
            group=heads // kv_heads,
            dtype=torch.float32,
            device=torch.device("cpu"),
        ),
    )
    k_new = torch.empty(q.shape[0], kv_heads, k_pool.shape[3])
    return paged_attention(q, k_new, k_new, k_pool, v_pool, meta, SCALE)


SHAPES = [
    (8, 4, 32),  # the benchmark's Llama: GQA group 2
    (4, 4, 64),  # no GQA
    (8, 2, 128),  # group 4, the widest specialised head size
    (6, 3, 20),  # a head size with a tail that is not a multiple of 8 (generic path)
]
LENS = [1, 15, 16, 17, 100, 130]


@pytest.mark.parametrize("path", ["native", "torch"])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), SHAPES)
def test_decode_matches_naive_attention(
    path: str, heads: int, kv_heads: int, head_dim: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    if path == "native" and attention._KERNEL is None:
        pytest.skip("the C kernel is not built here (or DYN_NATIVE=0)")
    if path == "torch":
        monkeypatch.setattr(attention, "_KERNEL", None)
    q, k_pool, v_pool, tables = _case(heads, kv_heads, head_dim, LENS, seed=head_dim)
    rows = [i + 2 for i in range(len(LENS))][::-1]  # decode rows after 2 others, shuffled
    out = _run(q, k_pool, v_pool, tables, LENS, rows)
    for row, table, n in zip(rows, tables, LENS, strict=True):
        expected = _naive(q[row], k_pool, v_pool, table, n)
        torch.testing.assert_close(out[row], expected, rtol=1e-5, atol=1e-5)


def test_decode_reads_a_strided_query() -> None:
    """q as the model passes it: the first heads of a [T, heads + kv_heads, D] rotary output."""
    if attention._KERNEL is None:
        pytest.skip("the C kernel is not built here (or DYN_NATIVE=0)")
    q, k_pool, v_pool, tables = _case(8, 4, 32, [40, 70], seed=1)
    qk = torch.cat((q, torch.randn(q.shape[0], 4, 32)), dim=1)
    strided = qk[:, :8]
    assert not strided.is_contiguous()
    out = _run(strided, k_pool, v_pool, tables, [40, 70], [0, 1])
    for row, (table, n) in enumerate(zip(tables, [40, 70], strict=True)):
        torch.testing.assert_close(out[row], _naive(q[row], k_pool, v_pool, table, n))


@pytest.mark.parametrize(
    ("tables", "lens", "message"),
    [
        ([[0, NUM_BLOCKS]], [20], "block id is out of range"),
        ([[0, -1]], [20], "block id is out of range"),
        ([[0]], [17], "does not fit its block table"),
    ],
)
def test_the_kernel_refuses_a_bad_table(
    tables: list[list[int]], lens: list[int], message: str
) -> None:
    """A table the kernel would read outside the pool with raises instead."""
    if attention._KERNEL is None:
        pytest.skip("the C kernel is not built here (or DYN_NATIVE=0)")
    q, k_pool, v_pool, _ = _case(8, 4, 32, [1], seed=2)
    with pytest.raises(ValueError, match=message):
        _run(q, k_pool, v_pool, tables, lens, [0])
