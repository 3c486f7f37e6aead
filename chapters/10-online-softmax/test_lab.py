"""Lab 10 tests: blocked_attention against textbook attention (float64), for
tiles that do not divide the lengths, causal offsets, GQA, and scores large
enough that a softmax without its running max overflows."""

from __future__ import annotations

import pytest
import torch
from _labkit import load

blocked_attention = load(__file__, "blocked_attention")


def textbook(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> torch.Tensor:
    """softmax(q kᵀ · scale) v in float64, the whole score matrix at once."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = q.double() @ k.transpose(-1, -2) * scale  # [batch, heads, q_len, kv_len]
    if causal:
        q_len, kv_len = q.shape[2], k.shape[2]
        q_pos = torch.arange(kv_len - q_len, kv_len)[:, None]
        scores = scores.masked_fill(torch.arange(kv_len)[None, :] > q_pos, float("-inf"))
    return scores.softmax(dim=-1) @ v


def run(
    q_len: int,
    kv_len: int,
    causal: bool = True,
    heads: tuple[int, int] = (4, 2),
    block_m: int = 4,
    block_n: int = 3,
    scale: float | None = None,
    magnitude: float = 1.0,
    seed: int = 0,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads = heads
    q = torch.randn(2, num_heads, q_len, 8, generator=gen) * magnitude
    k = torch.randn(2, num_kv_heads, kv_len, 8, generator=gen) * magnitude
    v = torch.randn(2, num_kv_heads, kv_len, 8, generator=gen)
    out = blocked_attention(q, k, v, causal=causal, scale=scale, block_m=block_m, block_n=block_n)
    expected = textbook(q, k, v, causal, 8**-0.5 if scale is None else scale)
    torch.testing.assert_close(
        out.double(),
        expected,
        atol=1e-4,
        rtol=1e-4,
        msg=lambda m: (
            f"q_len={q_len}, kv_len={kv_len}, causal={causal}, heads={heads}, "
            f"block_m={block_m}, block_n={block_n}, scale={scale}, magnitude={magnitude}: {m}"
        ),
    )


@pytest.mark.parametrize(("block_m", "block_n"), [(1, 1), (4, 3), (5, 16), (64, 64)])
def test_tiles_of_any_size(block_m: int, block_n: int) -> None:
    run(q_len=11, kv_len=11, block_m=block_m, block_n=block_n)


def test_not_causal() -> None:
    run(q_len=7, kv_len=13, causal=False)


def test_a_chunk_after_its_context() -> None:
    # 5 queries at positions 12..16 over 17 keys: bottom-right aligned.
    run(q_len=5, kv_len=17)


def test_a_single_decode() -> None:
    run(q_len=1, kv_len=20, block_n=6)


@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (4, 1)])
def test_head_layouts(heads: tuple[int, int]) -> None:
    run(q_len=6, kv_len=9, heads=heads, seed=1)


def test_the_scale_is_applied_as_given() -> None:
    run(q_len=6, kv_len=6, scale=0.05)


def test_large_scores_need_the_running_max() -> None:
    """Scores in the hundreds: exp overflows unless the max is subtracted, and
    the max grows from tile to tile, so earlier tiles must be rescaled."""
    run(q_len=8, kv_len=24, magnitude=12.0, block_n=4, seed=2)
