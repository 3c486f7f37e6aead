"""Lab 05 tests: apply_top_k_top_p against hand-worked rows and a slow version."""

from __future__ import annotations

import math

import pytest
import torch
from _labkit import load

apply_top_k_top_p = load(__file__, "apply_top_k_top_p")

NEG_INF = float("-inf")


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor([[math.log(x) for x in probs]])


def kept(result: torch.Tensor) -> list[list[int]]:
    """Per row, the vocabulary ids that survived."""
    return [torch.nonzero(row > NEG_INF).flatten().tolist() for row in result]


def slow_top_k_top_p(
    logits: torch.Tensor, k: list[int] | None, p: list[float] | None
) -> torch.Tensor:
    """Row by row, token by token, in float64: the definition."""
    out = logits.clone().double()
    for r, row in enumerate(out):
        if k is not None:
            kth = sorted(row.tolist(), reverse=True)[k[r] - 1]
            row[row < kth] = NEG_INF
        if p is not None:
            probs = row.softmax(-1).tolist()
            order = sorted(range(len(probs)), key=lambda i: probs[i])  # ascending
            cum = 0.0
            for i in order[:-1]:  # the largest always survives
                cum += probs[i]
                if cum <= 1 - p[r]:
                    row[i] = NEG_INF
    return out.float()


def test_no_filter_leaves_logits_alone() -> None:
    logits = torch.randn(3, 10)
    result = apply_top_k_top_p(logits.clone(), None, None)
    assert torch.equal(result, logits)
    vocab = torch.tensor([10, 10, 10])
    assert torch.equal(apply_top_k_top_p(logits.clone(), vocab, None), logits)  # k = vocab size
    assert torch.equal(apply_top_k_top_p(logits.clone(), None, torch.ones(3)), logits)  # p = 1


def test_top_k() -> None:
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0], [0.5, 0.25, 1.5, 0.75]])
    result = apply_top_k_top_p(logits.clone(), torch.tensor([2, 1]), None)
    assert result.tolist() == [[NEG_INF, 5.0, NEG_INF, 4.0], [NEG_INF, NEG_INF, 1.5, NEG_INF]]


def test_top_k_keeps_ties_with_the_kth() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0]])
    assert kept(apply_top_k_top_p(logits.clone(), torch.tensor([2]), None)) == [[1, 2]]
    assert kept(apply_top_k_top_p(logits.clone(), torch.tensor([3]), None)) == [[1, 2, 3]]


def test_top_p() -> None:
    # Probabilities 0.5 0.3 0.15 0.05. From the smallest, cumulative 0.05 0.2 0.5 1.0.
    probs = [0.5, 0.3, 0.15, 0.05]
    for p, survivors in ((0.9, [0, 1, 2]), (0.7, [0, 1]), (0.4, [0]), (0.01, [0])):
        result = apply_top_k_top_p(logits_of(probs), None, torch.tensor([p]))
        assert kept(result) == [survivors], p
        # Survivors keep their logits: the sampler softmaxes them again.
        assert torch.equal(result[0, survivors], logits_of(probs)[0, survivors])


def test_top_p_boundary_and_the_largest_always_survives() -> None:
    # Four equal logits: probabilities exactly 0.25, cumulative 0.25 0.5 0.75 1.0.
    # A cumulative sum equal to 1 - p is masked too.
    for p, num_kept in ((0.5, 2), (0.75, 3), (0.8, 4)):
        result = apply_top_k_top_p(torch.zeros(1, 4), None, torch.tensor([p]))
        assert len(kept(result)[0]) == num_kept, p
    # A p so small that 1 - p rounds to 1.0: the whole mass is <= 1 - p, yet
    # the largest logit must survive.
    result = apply_top_k_top_p(
        torch.tensor([[1.0, 3.0, 2.0]]), torch.tensor([1]), torch.tensor([1e-9])
    )
    assert result.tolist() == [[NEG_INF, 3.0, NEG_INF]]


def test_top_p_is_taken_after_top_k() -> None:
    # Top-2 leaves 0.4 and 0.3, renormalized to 0.571 and 0.429. With p = 0.5
    # the 0.429 is at most 1 - p: only the 0.4 survives. (Top-p on the full
    # distribution first would have kept both.)
    result = apply_top_k_top_p(
        logits_of([0.4, 0.3, 0.2, 0.1]), torch.tensor([2]), torch.tensor([0.5])
    )
    assert kept(result) == [[0]]


def test_rows_are_independent() -> None:
    logits = torch.cat([logits_of([0.5, 0.3, 0.15, 0.05])] * 3)
    k = torch.tensor([4, 1, 3])
    p = torch.tensor([0.7, 1.0, 0.9])
    assert kept(apply_top_k_top_p(logits, k, p)) == [[0, 1], [0], [0, 1, 2]]


@pytest.mark.parametrize("mode", ["k", "p", "both"])
def test_random_rows_against_the_slow_version(mode: str) -> None:
    gen = torch.Generator().manual_seed(0)
    num_reqs, vocab = 16, 50
    logits = torch.randn(num_reqs, vocab, generator=gen) * 3
    k_list = torch.randint(1, vocab + 1, (num_reqs,), generator=gen).tolist()
    p_list = (torch.rand(num_reqs, generator=gen) * 0.9 + 0.05).tolist()
    k = k_list if mode != "p" else None
    p = p_list if mode != "k" else None
    result = apply_top_k_top_p(
        logits.clone(),
        torch.tensor(k) if k is not None else None,
        torch.tensor(p, dtype=torch.float32) if p is not None else None,
    )
    expected = slow_top_k_top_p(logits, k, p)
    for r, (got_row, want_row) in enumerate(zip(kept(result), kept(expected))):
        assert got_row == want_row, (
            f"row {r} (k={k[r] if k else None}, p={p[r] if p else None}, logits "
            f"{[round(x, 3) for x in logits[r].tolist()]}): kept token ids {got_row}, "
            f"expected {want_row}"
        )
    survivors = expected > NEG_INF
    assert torch.equal(result[survivors], logits[survivors])
