"""Lab 11 tests: apply_token_bitmask_inplace on hand-made masks, against a
bit-by-bit version, and against xgrammar's own kernel."""

from __future__ import annotations

import pytest
import torch
from _labkit import load

apply_token_bitmask_inplace = load(__file__, "apply_token_bitmask_inplace")

NEG_INF = float("-inf")


def words(*values: int) -> torch.Tensor:
    """One mask row from Python ints (unsigned 32-bit patterns allowed)."""
    signed = [v - 2**32 if v >= 2**31 else v for v in values]
    return torch.tensor([signed], dtype=torch.int32)


def allowed(row: torch.Tensor) -> list[int]:
    return torch.nonzero(row > NEG_INF).flatten().tolist()


def slow_mask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Token by token: the definition."""
    out = logits.clone()
    for r in rows:
        for t in range(logits.shape[1]):
            word = int(bitmask[r, t // 32]) & 0xFFFFFFFF
            if not (word >> (t % 32)) & 1:
                out[r, t] = NEG_INF
    return out


def test_the_readme_example() -> None:
    logits = torch.arange(1.0, 9.0).unsqueeze(0)  # [1, 8]
    assert apply_token_bitmask_inplace(logits, words(0b101)) is None
    assert logits.tolist() == [[1.0, NEG_INF, 3.0, NEG_INF, NEG_INF, NEG_INF, NEG_INF, NEG_INF]]


def test_all_set_changes_nothing_all_clear_forbids_everything() -> None:
    logits = torch.randn(2, 64)
    expected = logits.clone()
    apply_token_bitmask_inplace(logits, torch.full((2, 2), -1, dtype=torch.int32))
    assert torch.equal(logits, expected)
    apply_token_bitmask_inplace(logits, torch.zeros(2, 2, dtype=torch.int32))
    assert (logits == NEG_INF).all()


def test_bit_order_and_the_sign_bit() -> None:
    # Word 0: bits 0 and 31 (the sign bit); word 1: bit 1 -> token 33.
    logits = torch.zeros(1, 64)
    apply_token_bitmask_inplace(logits, words(1 | 1 << 31, 1 << 1))
    assert allowed(logits[0]) == [0, 31, 33]


def test_allowed_logits_keep_their_values() -> None:
    logits = torch.tensor([[0.5, -3.25, 7.0, 0.125]])
    apply_token_bitmask_inplace(logits, words(0b1011))
    assert logits.tolist() == [[0.5, -3.25, NEG_INF, 0.125]]


def test_bits_past_the_vocabulary_are_ignored() -> None:
    # 40 tokens in two words; the second word's bits 8..31 are past the end.
    logits = torch.zeros(1, 40)
    apply_token_bitmask_inplace(logits, words(0, 0xFFFFFFFF))
    assert allowed(logits[0]) == list(range(32, 40))


def test_only_the_listed_rows_change() -> None:
    logits = torch.zeros(4, 32)
    bitmask = torch.cat([words(1), words(2), words(4), words(8)])
    apply_token_bitmask_inplace(logits, bitmask, indices=[1, 3])
    assert [allowed(row) for row in logits] == [list(range(32)), [1], list(range(32)), [3]]


@pytest.mark.parametrize("vocab_size", [32, 77, 1000])
def test_random_masks_against_the_definition(vocab_size: int) -> None:
    gen = torch.Generator().manual_seed(vocab_size)
    logits = torch.randn(6, vocab_size, generator=gen)
    num_words = (vocab_size + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (6, num_words), generator=gen, dtype=torch.int32)
    for rows in (None, [0, 2, 5]):
        got = logits.clone()
        apply_token_bitmask_inplace(got, bitmask, indices=rows)
        expected = slow_mask(logits, bitmask, list(range(6)) if rows is None else rows)
        assert torch.equal(got, expected), rows


def test_the_same_as_xgrammar() -> None:
    """What vLLM calls (xgr.apply_token_bitmask_inplace), on a real-sized row."""
    xgr = pytest.importorskip("xgrammar")
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 49152, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 1536), generator=gen, dtype=torch.int32)
    want, got = logits.clone(), logits.clone()
    xgr.apply_token_bitmask_inplace(want, bitmask, indices=[0, 2])
    apply_token_bitmask_inplace(got, bitmask, indices=[0, 2])
    assert torch.equal(got, want)
