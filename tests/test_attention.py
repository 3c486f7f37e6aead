"""The paged KV write and read against a naive reference on contiguous K/V."""

from __future__ import annotations

import pytest
import torch

from kernels.reshape_and_cache_flash import reshape_and_cache_flash_torch
from kernels.unified_attention import unified_attention_torch


def naive_attention(
    q: torch.Tensor,  # [q_len, num_heads, head_size]
    k: torch.Tensor,  # [seq_len, num_kv_heads, head_size]
    v: torch.Tensor,  # [seq_len, num_kv_heads, head_size]
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """softmax(QK^T) V with an explicit bottom-right causal mask, in float64.

    A sliding window of W lets the query at position p see keys p - W + 1 .. p
    (HF's ``kv_idx > q_idx - sliding_window``); a soft cap c turns each
    score s into ``c * tanh(s / c)`` (HF's Gemma-2), before the mask.
    """
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1).double()
    v = v.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale  # [heads, q_len, seq_len]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = torch.arange(q_len)[:, None] + (seq_len - q_len)
    k_pos = torch.arange(seq_len)[None, :]
    allowed = k_pos <= q_pos  # [q_len, seq_len]
    if sliding_window is not None:
        allowed &= k_pos > q_pos - sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).float()


def build_case(
    q_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    seed: int,
) -> dict:
    """Random K/V per request, written into a cache through shuffled block tables."""
    gen = torch.Generator().manual_seed(seed)
    num_reqs = len(q_lens)
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3
    # Block 0 is never used (vLLM's null block); the rest are handed out shuffled.
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    max_blocks = max(blocks_per_req) + 2
    block_table = torch.zeros(num_reqs, max_blocks, dtype=torch.int32)
    kv_cache = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_size, generator=gen)
    ks, vs = [], []
    for r, (s, nb) in enumerate(zip(seq_lens, blocks_per_req)):
        block_table[r, :nb] = torch.tensor(perm[:nb], dtype=torch.int32)
        perm = perm[nb:]
        k = torch.randn(s, num_kv_heads, head_size, generator=gen)
        v = torch.randn(s, num_kv_heads, head_size, generator=gen)
        pos = torch.arange(s)
        slots = block_table[r, pos // block_size].long() * block_size + pos % block_size
        reshape_and_cache_flash_torch(k, v, kv_cache, slots)
        ks.append(k)
        vs.append(v)
    num_tokens = sum(q_lens)
    q = torch.randn(num_tokens, num_heads, head_size, generator=gen)
    qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    return dict(
        q=q,
        kv_cache=kv_cache,
        qsl=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,
        ks=ks,
        vs=vs,
    )


CASES = [
    # (q_lens, seq_lens): mixed prefill + decode, chunk with context, partial blocks
    ([5, 1, 1, 3], [5, 17, 4, 19]),
    ([1], [1]),
    ([1, 1, 1], [16, 32, 33]),  # exactly on block boundaries, and one past
    ([16, 7], [16, 23]),
    ([1, 9, 1, 2], [64, 40, 5, 2]),
]


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 1)], ids=["mha", "gqa3", "gqa8"])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_unified_attention_matches_naive(
    block_size: int, heads: tuple[int, int], head_size: int, case: int
) -> None:
    num_heads, num_kv_heads = heads
    q_lens, seq_lens = CASES[case]
    c = build_case(q_lens, seq_lens, num_heads, num_kv_heads, head_size, block_size, seed=case)
    scale = head_size**-0.5
    out = torch.full_like(c["q"], float("nan"))
    unified_attention_torch(
        c["q"],
        c["kv_cache"],
        out,
        c["qsl"],
        c["seq_lens"],
        max(q_lens),
        max(seq_lens),
        c["block_table"],
        scale,
    )
    for r in range(len(q_lens)):
        a, b = int(c["qsl"][r]), int(c["qsl"][r + 1])
        ref = naive_attention(c["q"][a:b], c["ks"][r], c["vs"][r], scale)
        torch.testing.assert_close(out[a:b], ref, atol=1e-5, rtol=1e-5)


def test_unified_attention_ignores_stale_cache_content() -> None:
    """Slots past seq_len (stale data from a freed request) must not leak in."""
    c = build_case([1, 3], [6, 7], 4, 2, 64, 4, seed=1)
    outs = []
    for fill in (0.0, 1e4):
        cache = c["kv_cache"].clone()
        for r, s in enumerate([6, 7]):
            last = int(c["block_table"][r, (s - 1) // 4])
            cache[last, :, (s - 1) % 4 + 1 :] = fill
        out = torch.empty_like(c["q"])
        unified_attention_torch(
            c["q"], cache, out, c["qsl"], c["seq_lens"], 3, 7, c["block_table"], 0.125
        )
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)


def test_reshape_and_cache_flash_writes_exactly_the_slots() -> None:
    num_blocks, block_size, num_kv_heads, head_size = 6, 4, 2, 8
    cache = torch.zeros(num_blocks, 2, block_size, num_kv_heads, head_size)
    key = torch.randn(5, num_kv_heads, head_size)
    value = torch.randn(5, num_kv_heads, head_size)
    slots = torch.tensor([13, 2, -1, 23, 4])  # -1: a padding token, not written
    reshape_and_cache_flash_torch(key, value, cache, slots)
    expected = torch.zeros_like(cache)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            expected[s // block_size, 0, s % block_size] = key[t]
            expected[s // block_size, 1, s % block_size] = value[t]
    torch.testing.assert_close(cache, expected, atol=0, rtol=0)
    # Exactly four slots hold data.
    assert int((cache.abs().sum(dim=(1, 3, 4)) > 0).sum()) == 4


@pytest.mark.parametrize("contiguous", [True, False])
def test_gather_kv_reads_each_page_of_each_row(contiguous: bool) -> None:
    """``_gather_kv`` against an explicit loop over the block table, also on a
    non-contiguous cache (a slice of a larger one), where it must copy, not fail."""
    from kernels.unified_attention import _gather_kv

    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, num_kv_heads, head_size = 9, 4, 2, 8
    full = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_size + 3, generator=gen)
    cache = full[..., :head_size] if not contiguous else full[..., :head_size].contiguous()
    assert cache.is_contiguous() == contiguous
    table = torch.tensor([[3, 7, 1], [5, 0, 8]], dtype=torch.int32)
    key, value = _gather_kv(cache, table, 2)
    # [num_reqs, num_kv_heads, 2 * block_size, head_size]
    for r in range(2):
        for b in range(2):
            page = cache[int(table[r, b])]  # [2, block_size, num_kv_heads, head_size]
            rows = slice(b * block_size, (b + 1) * block_size)
            assert torch.equal(key[r, :, rows], page[0].transpose(0, 1))
            assert torch.equal(value[r, :, rows], page[1].transpose(0, 1))


# Windows: one key (itself), shorter than a block of 4, one and two blocks,
# and wider than every sequence here (a no-op).
WINDOWS = [1, 3, 4, 8, 100]


@pytest.mark.parametrize("softcap", [None, 1.0], ids=["window", "window+softcap"])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)], ids=["mha", "gqa3"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_unified_attention_sliding_window_matches_naive(
    window: int, softcap: float | None, heads: tuple[int, int], case: int
) -> None:
    """vLLM's window_size = (W - 1, 0): each query sees its last W keys, itself included."""
    num_heads, num_kv_heads = heads
    q_lens, seq_lens = CASES[case]
    c = build_case(q_lens, seq_lens, num_heads, num_kv_heads, 64, 4, seed=case)
    _check_against_naive(c, q_lens, seq_lens, window, softcap)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_unified_attention_softcap_matches_naive(block_size: int, case: int) -> None:
    """Gemma-2's soft cap alone: c * tanh(s / c) on every score, causal as before."""
    q_lens, seq_lens = CASES[case]
    c = build_case(q_lens, seq_lens, 6, 2, 64, block_size, seed=case)
    _check_against_naive(c, q_lens, seq_lens, None, 1.0)


def _check_against_naive(
    c: dict,
    q_lens: list[int],
    seq_lens: list[int],
    window: int | None,
    softcap: float | None,
) -> None:
    head_size = c["q"].shape[-1]
    scale = head_size**-0.5
    out = torch.full_like(c["q"], float("nan"))
    unified_attention_torch(
        c["q"],
        c["kv_cache"],
        out,
        c["qsl"],
        c["seq_lens"],
        max(q_lens),
        max(seq_lens),
        c["block_table"],
        scale,
        window_size=(window - 1, 0) if window is not None else (-1, -1),
        softcap=softcap or 0.0,
    )
    for r in range(len(q_lens)):
        a, b = int(c["qsl"][r]), int(c["qsl"][r + 1])
        ref = naive_attention(c["q"][a:b], c["ks"][r], c["vs"][r], scale, window, softcap)
        torch.testing.assert_close(out[a:b], ref, atol=1e-5, rtol=1e-5)


def free_pages_before_window(
    c: dict, q_lens: list[int], seq_lens: list[int], window: int, block_size: int, fill: float
) -> torch.Tensor:
    """The cache with every page that lies wholly before each request's first
    window filled with ``fill``: pages the KV manager freed and may hand on."""
    cache = c["kv_cache"].clone()
    for r, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        first_key = max(seq_len - q_len - window + 1, 0)  # the first query's window
        for page in range(first_key // block_size):
            cache[int(c["block_table"][r, page])] = fill
    return cache


def test_unified_attention_window_reads_no_page_before_it() -> None:
    """Pages wholly before every query's window are never read: NaN there changes nothing."""
    q_lens, seq_lens, window, block_size = [1, 6, 1], [40, 30, 9], 8, 4
    c = build_case(q_lens, seq_lens, 4, 2, 64, block_size, seed=7)
    outs = []
    for fill in (0.0, float("nan")):
        cache = free_pages_before_window(c, q_lens, seq_lens, window, block_size, fill)
        out = torch.empty_like(c["q"])
        unified_attention_torch(
            c["q"], cache, out, c["qsl"], c["seq_lens"], 6, 40, c["block_table"], 0.125,
            window_size=(window - 1, 0),
        )  # fmt: skip
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)
