"""Lab 04 tests: the paged read against naive attention over contiguous K/V."""

from __future__ import annotations

import pytest
import torch
from _labkit import load

unified_attention_torch = load(__file__, "unified_attention_torch")


def naive_attention(
    q: torch.Tensor,  # [Q, num_heads, head_size]
    k: torch.Tensor,  # [L, num_kv_heads, head_size]
    v: torch.Tensor,  # [L, num_kv_heads, head_size]
    scale: float,
) -> torch.Tensor:
    """Textbook causal attention in float64: query i at position L - Q + i."""
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.double().repeat_interleave(group, dim=1)  # [L, num_heads, head_size]
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale  # [num_heads, Q, L]
    query_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > query_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)  # [Q, num_heads, head_size]


def run_case(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_size: int = 8,
    block_size: int = 4,
    seed: int = 0,
) -> None:
    """Scatter each request's K/V into shuffled pages of a noisy cache, run
    the function under test, and compare with naive attention per request."""
    gen = torch.Generator().manual_seed(seed)
    num_reqs = len(query_lens)
    blocks_per_req = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(blocks_per_req) + 1  # a spare column of padding
    num_blocks = sum(blocks_per_req) + 3
    # Garbage everywhere: only the pages named by the block table may be read,
    # and only up to each seq_len.
    kv_cache = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_size, generator=gen) * 50
    physical = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0: padding
    block_table = torch.zeros(num_reqs, max_blocks, dtype=torch.int32)
    keys, values = [], []
    for r, seq_len in enumerate(seq_lens):
        ids = [physical.pop() for _ in range(blocks_per_req[r])]
        block_table[r, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(seq_len, num_kv_heads, head_size, generator=gen)
        v = torch.randn(seq_len, num_kv_heads, head_size, generator=gen)
        for p in range(seq_len):
            kv_cache[ids[p // block_size], 0, p % block_size] = k[p]
            kv_cache[ids[p // block_size], 1, p % block_size] = v[p]
        keys.append(k)
        values.append(v)

    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, num_heads, head_size, generator=gen)
    out = torch.full_like(q, float("nan"))
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    scale = 0.7 / head_size**0.5  # not the default: the scale must be applied as given
    result = unified_attention_torch(
        q=q,
        kv_cache=kv_cache,
        out=out,
        query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_table=block_table,
        softmax_scale=scale,
    )
    assert result is None, "the output goes into `out`, in place"
    for r in range(num_reqs):
        rows = slice(int(qsl[r]), int(qsl[r + 1]))
        expected = naive_attention(q[rows], keys[r], values[r], scale)
        torch.testing.assert_close(
            out[rows].double(),
            expected,
            atol=1e-5,
            rtol=1e-5,
            msg=lambda m, r=r: (
                f"request {r} of query_lens={query_lens}, seq_lens={seq_lens} "
                f"(block_size={block_size}, num_heads={num_heads}, "
                f"num_kv_heads={num_kv_heads}, block_table row "
                f"{block_table[r].tolist()}): {m}"
            ),
        )


def test_one_whole_prompt() -> None:
    run_case(query_lens=[10], seq_lens=[10])


def test_decodes_of_different_lengths() -> None:
    run_case(query_lens=[1, 1, 1, 1], seq_lens=[1, 5, 12, 4])


def test_a_chunk_sees_its_whole_context() -> None:
    # 6 new tokens after 9 already in the cache (a chunked prefill or a prefix hit).
    run_case(query_lens=[6], seq_lens=[15])


def test_a_mixed_batch() -> None:
    # A whole prompt, two decodes, a later chunk, one more decode.
    run_case(query_lens=[7, 1, 1, 5, 1], seq_lens=[7, 20, 3, 13, 9], seed=1)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 2), (4, 1)])
def test_head_layouts(num_heads: int, num_kv_heads: int) -> None:
    """MHA, GQA with 3 query heads per KV head, and MQA."""
    run_case([3, 1, 4], [3, 10, 9], num_heads=num_heads, num_kv_heads=num_kv_heads, seed=2)


@pytest.mark.parametrize("block_size", [1, 16])
def test_block_sizes(block_size: int) -> None:
    run_case([5, 1, 2], [5, 18, 33], block_size=block_size, seed=3)
