"""Lab 12 tests: accept_draft_tokens on hand-made drafts, and, drawn many
times, the target's distribution (the reason the rule exists)."""

from __future__ import annotations

import math
import random

import pytest
from _labkit import load

accept_draft_tokens = load(__file__, "accept_draft_tokens")


def greedy(drafts: list[int], argmax: list[int], bonus: int = 99) -> list[int]:
    return accept_draft_tokens(drafts, bonus, True, argmax, None, None, None, None)


def test_greedy_all_drafts_match_then_the_bonus() -> None:
    assert greedy([5, 6, 7], [5, 6, 7]) == [5, 6, 7, 99]


def test_greedy_stops_at_the_first_mismatch_with_the_targets_token() -> None:
    assert greedy([5, 8, 7], [5, 6, 7]) == [5, 6]
    assert greedy([4, 6, 7], [5, 6, 7]) == [5]
    # A later draft that would match does not count once one was rejected.
    assert greedy([1, 2], [3, 2]) == [3]


def test_no_drafts_is_just_the_bonus() -> None:
    assert greedy([], []) == [99]
    assert accept_draft_tokens([], 7, False, [], [], None, [], []) == [7]


def test_random_keeps_a_draft_when_u_is_at_most_p_over_q() -> None:
    drafts, recovered = [5, 6], [50, 60]
    p, q = [0.3, 0.2], [0.6, 0.1]
    # p/q = 0.5 at the first draft, 2 (always kept) at the second.
    keep_both = accept_draft_tokens(drafts, 9, False, [0, 0], p, q, [0.5, 0.999], recovered)
    assert keep_both == [5, 6, 9]
    assert accept_draft_tokens(drafts, 9, False, [0, 0], p, q, [0.51, 0.0], recovered) == [50]


def test_random_without_draft_probabilities_means_q_is_1() -> None:
    drafts, recovered, p = [5, 6], [50, 60], [0.3, 0.2]
    assert accept_draft_tokens(drafts, 9, False, [0, 0], p, None, [0.3, 0.3], recovered) == [5, 60]


def test_a_draft_the_draft_model_gave_probability_0_is_rejected() -> None:
    assert accept_draft_tokens([5], 9, False, [0], [0.5], [0.0], [0.0], [50]) == [50]


def test_random_ignores_the_argmax() -> None:
    # The argmax is 0 everywhere; a random request must not look at it.
    assert accept_draft_tokens([5], 9, False, [0], [0.9], None, [0.1], [50]) == [5, 9]


@pytest.mark.parametrize("with_q", [True, False], ids=["draft-probs", "ngram"])
def test_many_draws_follow_the_target_distribution(with_q: bool) -> None:
    """p (target) and q (draft) over 5 tokens: draw the draft from q, u, the
    recovered token from norm(max(p - q, 0)), and call the rule; the first
    emitted token must follow p. Chi-square over 5 tokens at 0.001 (fixed
    seed: a right rule passes every run)."""
    p = [0.1, 0.4, 0.2, 0.2, 0.1]
    q = [0.4, 0.1, 0.3, 0.1, 0.1] if with_q else None
    rng = random.Random(0)
    counts = [0] * 5
    n = 20000
    for _ in range(n):
        draft = rng.choices(range(5), q)[0] if q else 2  # an n-gram draft: always 2
        q_draft = q[draft] if q else 1.0
        residual = [max(pi - (q[i] if q else float(i == draft)), 0.0) for i, pi in enumerate(p)]
        recovered = rng.choices(range(5), residual)[0]
        bonus = rng.choices(range(5), p)[0]
        out = accept_draft_tokens(
            [draft], bonus, False, [1], [p[draft]], [q_draft] if q else None,
            [rng.random()], [recovered],
        )  # fmt: skip
        counts[out[0]] += 1
    stat = sum((c - n * pi) ** 2 / (n * pi) for c, pi in zip(counts, p))
    # The chi-square critical value for 4 degrees of freedom at 0.001.
    assert stat < 18.47, (counts, stat)
    assert not math.isnan(stat)
