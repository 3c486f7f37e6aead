"""Speculative decoding, piece by piece: the n-gram lookup, the rejection
sampler on hand-made p and q, the spec-decode metadata, the scheduler's
drafts (budget, KV slots, rollback, stops in the middle of a run), and bad
configurations refused at the entry. The engine-level tests are in
test_spec_decode_engine.py (tiny models) and test_spec_decode_lossless.py
(the real model)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tests.test_scheduler import BS, EOS, check_blocks, make_request, make_scheduler
from tracevllm.config import ModelConfig, SpeculativeConfig
from tracevllm.core.sched.scheduler import Scheduler
from tracevllm.outputs import DraftTokenIds, ModelRunnerOutput
from tracevllm.sample.logits_processor import (
    LogitBiasLogitsProcessor,
    LogitsProcessors,
    MinTokensLogitsProcessor,
)
from tracevllm.sample.metadata import SamplingMetadata
from tracevllm.sample.rejection_sampler import (
    PLACEHOLDER_TOKEN_ID,
    RejectionSampler,
    accept_draft_tokens,
    rejection_sample,
    sample_recovered_tokens,
)
from tracevllm.sample.sampler import Sampler
from tracevllm.spec_decode.metadata import SpecDecodeMetadata
from tracevllm.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens

K = 3


# ---------------------------------------------------------------- n-gram lookup
@pytest.mark.parametrize(
    "tokens, min_n, max_n, k, expected",
    [
        # "1 2 3" ends the context and occurred at 0: what followed it then.
        ([1, 2, 3, 4, 1, 2, 3], 2, 3, 3, [4, 1, 2]),
        # Two earlier "1 2 3"s: the earliest wins (vLLM's choice).
        ([1, 2, 3, 4, 1, 2, 3, 9, 1, 2, 3], 2, 3, 3, [4, 1, 2]),
        # The longest match wins over a shorter, later one: "5 1 2 3" at 0.
        ([5, 1, 2, 3, 8, 2, 3, 7, 5, 1, 2, 3], 1, 4, 2, [8, 2]),
        # Capped at max_n: only "2 3" may count, and it first occurred at 1.
        ([5, 2, 3, 8, 1, 2, 3, 7, 1, 2, 3], 2, 2, 2, [8, 1]),
        # Shorter than min_n: nothing.
        ([1, 2, 3, 4, 1, 2, 3], 4, 5, 3, []),
        # Fewer than k tokens follow the match: as many as there are.
        ([7, 7], 1, 1, 3, [7]),
        # No repeat at all.
        ([1, 2, 3, 4], 1, 3, 3, []),
    ],
)
def test_ngram_finds_the_longest_earliest_match(
    tokens: list[int], min_n: int, max_n: int, k: int, expected: list[int]
) -> None:
    assert _find_longest_matched_ngram_and_propose_tokens(tokens, min_n, max_n, 100, k) == expected


def test_ngram_matches_a_brute_force_search() -> None:
    """On random short sequences over a tiny alphabet (many repeats)."""

    def brute(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
        for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
            suffix = tokens[-n:]
            for start in range(len(tokens) - n):  # earliest first, not the suffix itself
                if tokens[start : start + n] == suffix:
                    return tokens[start + n : start + n + k]
        return []

    rng = np.random.default_rng(0)
    for _ in range(400):
        tokens = rng.integers(0, 3, size=int(rng.integers(1, 14))).tolist()
        min_n = int(rng.integers(1, 4))
        max_n = int(rng.integers(min_n, 5))
        got = _find_longest_matched_ngram_and_propose_tokens(tokens, min_n, max_n, 100, K)
        assert got == brute(tokens, min_n, max_n, K), (tokens, min_n, max_n)


def test_ngram_with_a_huge_prompt_lookup_max() -> None:
    """No n-gram is longer than the context: prompt_lookup_max = 10**12
    must not allocate a table of that size (a MemoryError in the engine)."""
    tokens = [1, 2, 3, 4, 1, 2, 3]
    assert _find_longest_matched_ngram_and_propose_tokens(tokens, 1, 10**12, 100, 3) == [4, 1, 2]


def test_ngram_stops_at_max_model_len() -> None:
    tokens = [1, 2, 3, 4, 1, 2, 3]
    assert _find_longest_matched_ngram_and_propose_tokens(tokens, 2, 3, 9, 3) == [4, 1]
    assert _find_longest_matched_ngram_and_propose_tokens(tokens, 2, 3, 7, 3) == []


# ----------------------------------------------------------- the acceptance rule
def test_greedy_keeps_drafts_while_they_match_the_argmax() -> None:
    argmax = [5, 6, 7]
    assert accept_draft_tokens([5, 6, 7], 9, True, argmax, None, None, None, None) == [5, 6, 7, 9]
    # The first mismatch ends the run with the target's own token.
    assert accept_draft_tokens([5, 8, 7], 9, True, argmax, None, None, None, None) == [5, 6]
    assert accept_draft_tokens([4, 6, 7], 9, True, argmax, None, None, None, None) == [5]
    assert accept_draft_tokens([], 9, True, [], None, None, None, None) == [9]


def test_random_accepts_with_probability_p_over_q() -> None:
    drafts, recovered = [5, 6], [50, 60]
    p, q = [0.3, 0.2], [0.6, 0.1]
    # u < p/q = 0.5 accepts the first; p/q = 2 >= any u accepts the second.
    assert accept_draft_tokens(drafts, 9, False, [0, 0], p, q, [0.49, 0.99], recovered) == [
        5,
        6,
        9,
    ]
    # u > 0.5 rejects the first: its recovered token, then nothing.
    assert accept_draft_tokens(drafts, 9, False, [0, 0], p, q, [0.51, 0.0], recovered) == [50]
    # No q (an n-gram draft): q = 1, accept iff u <= p.
    assert accept_draft_tokens(drafts, 9, False, [0, 0], p, None, [0.25, 0.3], recovered) == [
        5,
        60,
    ]
    # q = 0: rejected, never a division by zero.
    assert accept_draft_tokens([5], 9, False, [0], [0.5], [0.0], [0.0], [50]) == [50]


def _metadata(num_draft_tokens: list[int], draft_token_ids: list[int]) -> SpecDecodeMetadata:
    """Rows of logits laid out as the runner does: each request's draft
    positions, then its bonus position."""
    num_sampled = [n + 1 for n in num_draft_tokens]
    starts = np.cumsum([0, *num_sampled[:-1]])
    target = [s + i for s, n in zip(starts, num_draft_tokens) for i in range(n)]
    bonus = [s + n for s, n in zip(starts, num_draft_tokens)]
    return SpecDecodeMetadata(
        draft_token_ids=torch.tensor(draft_token_ids, dtype=torch.int32),
        num_draft_tokens=num_draft_tokens,
        cu_num_draft_tokens=torch.tensor(np.cumsum(num_draft_tokens)),
        cu_num_sampled_tokens=torch.tensor(np.cumsum(num_sampled)),
        target_logits_indices=torch.tensor(target, dtype=torch.int64),
        bonus_logits_indices=torch.tensor(bonus, dtype=torch.int64),
        logits_indices=torch.arange(sum(num_sampled)),
    )


def _random_metadata(batch: int, generators: dict[int, torch.Generator]) -> SamplingMetadata:
    return SamplingMetadata(
        temperature=torch.ones(batch),
        all_greedy=False,
        all_random=True,
        top_p=None,
        top_k=None,
        generators=generators,
        max_num_logprobs=None,
    )


def chi_square_p_value(observed: np.ndarray, expected: np.ndarray) -> float:
    """Pearson's test of counts against expected counts (all expected >= 5)."""
    stat = float(((observed - expected) ** 2 / expected).sum())
    dof = len(observed) - 1
    # The chi-square survival function: the regularized upper incomplete gamma.
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))


# Significance: a correct sampler fails a seeded test with probability 1e-3
# at most (the seeds are fixed, so a pass is a pass every run).
ALPHA = 1e-3


@pytest.mark.parametrize("with_q", [True, False], ids=["draft-probs", "ngram"])
def test_rejection_sampler_keeps_the_target_distribution(with_q: bool) -> None:
    """Hand-made p (target) and q (draft): the first emitted token follows p.

    N requests with the same p and q, each draws its draft from q (an
    n-gram draft: always the same token). Whether the draft is kept or a
    token recovered from max(p - q, 0), the first token must be distributed
    as p: a chi-square test over the vocabulary, at ALPHA.
    """
    vocab = 6
    p = torch.tensor([0.05, 0.40, 0.10, 0.25, 0.15, 0.05])
    q = torch.tensor([0.30, 0.05, 0.30, 0.05, 0.20, 0.10])
    n = 20000
    gen = torch.Generator().manual_seed(1)
    if with_q:
        drafts = torch.multinomial(q.expand(n, vocab), 1, generator=gen).squeeze(1)
        draft_probs = q.expand(n, vocab).contiguous()
    else:
        drafts = torch.full((n,), 2)  # p(2) = 0.10: mostly rejected
        draft_probs = None
    # One draft per request: its row and its bonus row, both from log p.
    logits = p.log().expand(2 * n, vocab).contiguous()
    metadata = _metadata([1] * n, drafts.tolist())
    generators = {i: torch.Generator().manual_seed(1000 + i) for i in range(n)}
    sampler = RejectionSampler(Sampler())
    out = sampler(metadata, draft_probs, logits, _random_metadata(n, generators))
    first = out.sampled_token_ids[:, 0].numpy()
    observed = np.bincount(first, minlength=vocab)
    assert chi_square_p_value(observed, p.numpy() * n) > ALPHA
    # And the rule did reject: some first tokens are not the draft.
    assert (first != drafts.numpy()).mean() > 0.2


def test_rejection_sample_greedy_and_random_in_one_batch() -> None:
    """Greedy rows take the argmax whatever the noise; -1 pads after a rejection."""
    vocab = 4
    # Request 0 (greedy): drafts [1, 2], argmax [1, 3] -> [1, 3].
    # Request 1 (random): p puts all mass on its drafts -> both kept, then the bonus.
    target = torch.full((4, vocab), -30.0)
    for row, token in enumerate([1, 3, 0, 2]):
        target[row, token] = 0.0
    md = SamplingMetadata(
        temperature=torch.tensor([0.0, 1.0]),
        all_greedy=False,
        all_random=False,
        top_p=None,
        top_k=None,
        generators={},
        max_num_logprobs=None,
    )
    out = rejection_sample(
        torch.tensor([1, 2, 0, 2], dtype=torch.int32),
        [2, 2],
        2,
        torch.tensor([2, 4], dtype=torch.int32),
        None,
        target,
        torch.tensor([[9], [8]]),
        md,
    )
    assert out.tolist() == [[1, 3, PLACEHOLDER_TOKEN_ID], [0, 2, 8]]


def test_parse_output_drops_placeholders_and_discarded_rows() -> None:
    out = torch.tensor([[4, 5, -1], [6, -1, -1], [7, 8, 9]], dtype=torch.int32)
    tokens, logprobs = RejectionSampler.parse_output(out, 100, discard_req_indices=[1])
    assert tokens == [[4, 5], [], [7, 8, 9]]
    assert logprobs is None


def test_a_draft_counts_in_the_penalties_of_the_positions_after_it() -> None:
    """Token 1 leads token 2 by 0.1 everywhere; a presence penalty of 0.5
    turns that round once 1 has been generated. Plain decoding gives 1, 2;
    so must drafts [1, 1]: the second position sees the first draft as
    generated, so the target picks 2 there and the second draft is rejected."""
    row = torch.tensor([0.0, 1.0, 0.9, 0.0])
    md = SamplingMetadata(
        temperature=None,
        all_greedy=True,
        all_random=False,
        top_p=None,
        top_k=None,
        generators={},
        max_num_logprobs=None,
        no_penalties=False,
        prompt_token_ids=torch.tensor([[3]]),
        frequency_penalties=torch.zeros(1),
        presence_penalties=torch.tensor([0.5]),
        repetition_penalties=torch.ones(1),
        output_token_ids=[[]],
        spec_token_ids=[[1, 1]],
    )
    sampler = RejectionSampler(Sampler())
    out = sampler(_metadata([2], [1, 1]), None, row.expand(3, 4).clone(), md)
    assert out.sampled_token_ids.tolist() == [[1, 2, PLACEHOLDER_TOKEN_ID]]


# ----------------------------------------------- called as vLLM 0.22.0's tests call it
def test_make_dummy_is_vllms() -> None:
    md = SpecDecodeMetadata.make_dummy([[1, 2, 3], [], [4, 5]], device="cpu")
    assert md.draft_token_ids.tolist() == [1, 2, 3, 4, 5]
    assert md.draft_token_ids.dtype == torch.int32
    assert md.num_draft_tokens == [3, 0, 2] and md.max_spec_len == 3
    assert md.cu_num_draft_tokens.tolist() == [3, 3, 5]
    assert md.cu_num_sampled_tokens.tolist() == [4, 5, 8]
    assert md.target_logits_indices.tolist() == [0] * 5
    assert md.bonus_logits_indices.tolist() == [0] * 3
    assert md.logits_indices.tolist() == [0] * 8


def _target_then_bonus_logits(target: list[list[int]], bonus: list[int], vocab: int = 100):
    """vLLM's test logits: row i's argmax is the i-th target token (100 vs
    -100), then one row per request for its bonus; and make_dummy's metadata
    pointed at them."""
    rows = [t for tokens in target for t in tokens] + bonus
    logits = torch.full((len(rows), vocab), -100.0)
    logits[torch.arange(len(rows)), torch.tensor(rows)] = 100.0
    num_target = len(rows) - len(bonus)
    return logits, num_target


@pytest.mark.parametrize(
    "spec_tokens, target, bonus, expected",
    [
        ([[1, 2, 3]], [[1, 2, 3]], [4], [[1, 2, 3, 4]]),  # perfect match, then the bonus
        ([[1, 2, 3]], [[1, 5, 3]], [4], [[1, 5, -1, -1]]),  # early mismatch
        ([[1, 2], [3]], [[1, 2], [3]], [5, 4], [[1, 2, 5], [3, 4, -1]]),
        ([[]], [[]], [5], [[5]]),  # no drafts: the bonus only
        ([[1, 2, 3], [4, 5, 6]], [[1, 2, 7], [4, 8, 6]], [6, 9], [[1, 2, 7, -1], [4, 8, -1, -1]]),
    ],
)
def test_greedy_rejection_sampler_as_vllms_tests_call_it(
    spec_tokens: list[list[int]],
    target: list[list[int]],
    bonus: list[int],
    expected: list[list[int]],
) -> None:
    """vLLM's tests/v1/sample/test_rejection_sampler.py calls: make_dummy, its
    indices set, the sampler called with keywords; a real Sampler draws the
    bonus token from the bonus rows."""
    logits, num_target = _target_then_bonus_logits(target, bonus)
    metadata = SpecDecodeMetadata.make_dummy(spec_tokens, device=logits.device)
    metadata.target_logits_indices = torch.arange(num_target)
    metadata.bonus_logits_indices = torch.arange(num_target, len(logits))
    sampling_metadata = _vllm_sampling_metadata(all_greedy=True)
    output = RejectionSampler(Sampler())(
        metadata, draft_probs=None, logits=logits, sampling_metadata=sampling_metadata
    )
    assert torch.equal(output.sampled_token_ids, torch.tensor(expected, dtype=torch.int))


def _vllm_sampling_metadata(
    all_greedy: bool,
    temperature: torch.Tensor | None = None,
    generators: dict[int, torch.Generator] | None = None,
    **kwargs: object,
) -> SamplingMetadata:
    """As vLLM's test helper builds one: every field by name."""
    fields: dict[str, Any] = dict(
        temperature=None if all_greedy else temperature,
        all_greedy=all_greedy,
        all_random=not all_greedy,
        top_p=None,
        top_k=None,
        generators=generators or {},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.tensor([]),
        presence_penalties=torch.tensor([]),
        repetition_penalties=torch.tensor([]),
        output_token_ids=[],
        spec_token_ids=[],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )
    return SamplingMetadata(**{**fields, **kwargs})


def test_frequency_penalties_see_the_drafts_before_each_position() -> None:
    """vLLM's test_frequency_penalties, with make_dummy's all-zero indices:
    every row is row 0 (token 1 at 100, token 15 at 99). A penalty of 1.5 per
    earlier 1 turns the pick to 15 after one 1; a penalty of 0.7, after two.
    Here the bonus comes from a real Sampler (row 0 too): request 1, with no
    drafts and no 1 in its past, takes 1."""
    spec_tokens = [[1, 1, 1], [], [1, 1, 1]]
    logits = torch.full((6, 100), -100.0)
    logits[:, 1], logits[:, 15] = 100.0, 99.0
    md = _vllm_sampling_metadata(
        all_greedy=True,
        no_penalties=False,
        output_token_ids=[[2], [3], [4]],
        spec_token_ids=spec_tokens,
        prompt_token_ids=torch.tensor([[5, 6, 7], [6, 7, 8], [7, 8, 9]]),
        frequency_penalties=torch.tensor([1.5, 1.5, 0.7]),
        presence_penalties=torch.zeros(3),
        repetition_penalties=torch.ones(3),
    )
    metadata = SpecDecodeMetadata.make_dummy(spec_tokens, device=logits.device)
    output = RejectionSampler(Sampler())(
        metadata, draft_probs=None, logits=logits, sampling_metadata=md
    )
    expected = [[1, 15, -1, -1], [1, -1, -1, -1], [1, 1, 15, -1]]
    assert output.sampled_token_ids.tolist() == expected


def test_the_bonus_token_comes_from_sampler_forward() -> None:
    """As vLLM: the rejection sampler calls its sampler with
    ``predict_bonus_token=True`` on the bonus rows; the penalties and
    min-tokens there count the request's drafts as generated."""

    class WatchedSampler(Sampler):
        calls: list[tuple[int, bool]] = []

        def forward(self, logits, sampling_metadata, predict_bonus_token=False):  # type: ignore[no-untyped-def, override]
            self.calls.append((len(logits), predict_bonus_token))
            return super().forward(logits, sampling_metadata, predict_bonus_token)

    logits, num_target = _target_then_bonus_logits([[1, 2]], [4])
    metadata = SpecDecodeMetadata.make_dummy([[1, 2]], device="cpu")
    metadata.target_logits_indices = torch.arange(num_target)
    metadata.bonus_logits_indices = torch.arange(num_target, len(logits))
    sampler = WatchedSampler()
    out = RejectionSampler(sampler)(metadata, None, logits, _vllm_sampling_metadata(True))
    assert out.sampled_token_ids.tolist() == [[1, 2, 4]]
    assert sampler.calls == [(1, True)]

    # The bonus row alone: token 4 leads 5 by 0.5; a presence penalty of 1 on
    # 4 applies only if the drafts (which hold a 4) count as generated.
    row = torch.zeros(1, 8)
    row[0, 4], row[0, 5] = 1.0, 0.5
    md = _vllm_sampling_metadata(
        all_greedy=True,
        no_penalties=False,
        output_token_ids=[[]],
        spec_token_ids=[[4, 6]],
        prompt_token_ids=torch.tensor([[7]]),
        frequency_penalties=torch.zeros(1),
        presence_penalties=torch.ones(1),
        repetition_penalties=torch.ones(1),
    )
    bonus = Sampler()(row.clone(), md, predict_bonus_token=True).sampled_token_ids.tolist()
    plain = Sampler()(row.clone(), md).sampled_token_ids.tolist()
    assert (bonus, plain) == ([[5]], [[4]])
    # Min-tokens 3 with one token out and two drafts: the bonus is the fourth
    # token, EOS (4) is allowed; with min-tokens 4 it is not.
    for min_tokens, expected in ((3, 4), (4, 5)):
        md = _vllm_sampling_metadata(
            all_greedy=True,
            output_token_ids=[[9]],
            spec_token_ids=[[6, 6]],
            logitsprocs=LogitsProcessors([MinTokensLogitsProcessor({0: (min_tokens, [9], {4})})]),
        )
        out = Sampler()(row.clone(), md, predict_bonus_token=True).sampled_token_ids
        assert out.item() == expected


def test_logit_bias_applies_at_every_draft_position() -> None:
    """Every row favours token 1 (100) over 15 (99); a +5 bias on 15 for
    request 0 makes the target pick 15 at its first draft position (so the
    draft 1 is rejected) and at its bonus; request 1 has no bias."""
    logits = torch.full((6, 100), -100.0)
    logits[:, 1], logits[:, 15] = 100.0, 99.0
    metadata = SpecDecodeMetadata.make_dummy([[1, 1], [1, 1]], device="cpu")
    metadata.target_logits_indices = torch.tensor([0, 1, 3, 4])
    metadata.bonus_logits_indices = torch.tensor([2, 5])
    md = _vllm_sampling_metadata(
        all_greedy=True,
        logitsprocs=LogitsProcessors([LogitBiasLogitsProcessor({0: {15: 5.0}})]),
    )
    out = RejectionSampler(Sampler())(metadata, None, logits, md)
    assert out.sampled_token_ids.tolist() == [[15, -1, -1], [1, 1, 1]]


def _slow_recovered_tokens(
    num_draft_tokens: list[int],
    draft_token_ids: torch.Tensor,  # [num_tokens]
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generators: dict[int, torch.Generator],
) -> list[int]:
    """The recovered-token rule one position at a time: argmax over the
    vocabulary of max(p - q, 0) / E, with E the request's exponential row."""
    vocab = target_probs.shape[1]
    out = []
    pos = 0
    for req, n in enumerate(num_draft_tokens):
        e = torch.empty(vocab).exponential_(generator=generators[req])
        for _ in range(n):
            prob = target_probs[pos].clone()
            if draft_probs is None:
                prob[int(draft_token_ids[pos])] = 0.0
            else:
                prob = (prob - draft_probs[pos]).clamp_min(0.0)
            out.append(int((prob / e).argmax()))
            pos += 1
    return out


@pytest.mark.parametrize("no_draft_probs", [True, False])
@pytest.mark.parametrize("shape", ["flat", "column"])
def test_sample_recovered_tokens_takes_vllms_arguments(no_draft_probs: bool, shape: str) -> None:
    """``sample_recovered_tokens(max_spec_len, num_draft_tokens,
    cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs,
    sampling_metadata, device)`` as vLLM's test calls it (draft ids as
    [num_tokens, 1] int32 there): the result has the draft ids' shape and
    dtype, and every request seeded gives the slow rule's tokens."""
    num_draft_tokens, vocab = [3, 0, 2, 1], 300
    num_tokens = sum(num_draft_tokens)
    gen = torch.Generator().manual_seed(0)
    draft_probs = torch.rand(num_tokens, vocab, generator=gen).softmax(-1)
    target_probs = torch.rand(num_tokens, vocab, generator=gen).softmax(-1)
    draft_ids = torch.multinomial(draft_probs, 1, generator=gen).to(torch.int32)
    if shape == "flat":
        draft_ids = draft_ids.squeeze(1)
    metadata = SpecDecodeMetadata.make_dummy([[0] * n for n in num_draft_tokens], "cpu")

    def seeded() -> dict[int, torch.Generator]:
        return {i: torch.Generator().manual_seed(100 + i) for i in range(len(num_draft_tokens))}

    md = _vllm_sampling_metadata(False, torch.ones(4), generators=seeded())
    recovered = sample_recovered_tokens(
        metadata.max_spec_len,
        metadata.num_draft_tokens,
        metadata.cu_num_draft_tokens,
        draft_ids,
        None if no_draft_probs else draft_probs,
        target_probs,
        md,
        device="cpu",
    )
    assert recovered.shape == draft_ids.shape and recovered.dtype == torch.int32
    expected = _slow_recovered_tokens(
        num_draft_tokens,
        draft_ids.reshape(-1),
        None if no_draft_probs else draft_probs,
        target_probs,
        seeded(),
    )
    assert recovered.reshape(-1).tolist() == expected


def test_seeded_requests_are_deterministic_as_vllms_test_checks() -> None:
    """vLLM's test_deterministic_when_seeded: a seeded request's output is the
    same every run, whatever the unseeded ones draw."""
    batch, k, vocab = 4, 3, 50
    gen = torch.Generator().manual_seed(3)
    draft_probs = torch.rand(batch * k, vocab, generator=gen).softmax(-1)
    logits = torch.rand(batch * k + batch, vocab, generator=gen)
    drafts = torch.randint(0, vocab, (batch, k), generator=gen).tolist()
    results = []
    for rep in range(5):
        torch.manual_seed(rep)  # the unseeded requests' noise changes
        generators = {i: torch.Generator().manual_seed(i) for i in (0, 2)}
        md = _vllm_sampling_metadata(False, torch.ones(batch), generators=generators)
        metadata = _metadata([k] * batch, [t for d in drafts for t in d])
        out = RejectionSampler(Sampler())(
            metadata, draft_probs=draft_probs, logits=logits, sampling_metadata=md
        )
        results.append(out.sampled_token_ids)
    for r in results[1:]:
        assert torch.equal(r[0], results[0][0]) and torch.equal(r[2], results[0][2])
    assert any(not torch.equal(r[1], results[0][1]) for r in results[1:])


def test_spec_decode_metadata_indices(tmp_path: object) -> None:
    """vLLM's worked example of _calc_spec_decode_metadata."""
    from tracevllm.worker.model_runner import ModelRunner

    class Batch:
        req_ids = ["a", "b", "c", "d", "e"]

    class SO:
        scheduled_spec_decode_tokens = {"a": [1, 2, 3], "c": [4, 5], "e": [6]}

    runner = ModelRunner.__new__(ModelRunner)
    runner.input_batch = Batch()  # type: ignore[assignment]
    runner.arange_np = np.arange(64)
    runner.device = torch.device("cpu")
    md = runner._calc_spec_decode_metadata(SO(), np.array([4, 104, 107, 207, 209]))  # type: ignore[arg-type]
    assert md.logits_indices.tolist() == [0, 1, 2, 3, 103, 104, 105, 106, 206, 207, 208]
    assert md.target_logits_indices.tolist() == [0, 1, 2, 5, 6, 9]
    assert md.bonus_logits_indices.tolist() == [3, 4, 7, 8, 10]
    assert md.cu_num_draft_tokens.tolist() == [3, 3, 5, 5, 6]
    assert md.draft_token_ids.tolist() == [1, 2, 3, 4, 5, 6]
    assert md.max_spec_len == 3


# ------------------------------------------------------------------ the scheduler
def spec_scheduler(method: str = "ngram", **kwargs: object) -> Scheduler:
    config = SpeculativeConfig(
        method=method,
        num_speculative_tokens=K,
        model=None if method == "ngram" else "a-draft-model",
    )
    return make_scheduler(speculative_config=config, **kwargs)  # type: ignore[arg-type]


def emit(sched: Scheduler, tokens: dict[str, list[int]]) -> tuple[object, dict]:
    """One step in which request r emits tokens[r] (accepted drafts + one)."""
    so = sched.schedule()
    req_ids = list(so.num_scheduled_tokens)
    out = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[tokens.get(r, []) for r in req_ids],
    )
    return so, sched.update_from_output(so, out)


def propose(sched: Scheduler, drafts: dict[str, list[int]]) -> None:
    sched.update_draft_token_ids(DraftTokenIds(list(drafts), list(drafts.values())))


def test_drafts_are_scheduled_counted_and_rolled_back() -> None:
    sched = spec_scheduler()
    req = make_request("a", 6, max_tokens=20)
    sched.add_request(req)
    emit(sched, {"a": [7]})  # the prefill
    assert (req.num_tokens, req.num_computed_tokens) == (7, 6)
    propose(sched, {"a": [11, 12, 13]})
    assert req.num_tokens_with_spec == 10

    so, outputs = emit(sched, {"a": [11, 99]})  # one draft kept, then the target's own
    assert so.num_scheduled_tokens == {"a": 1 + K}  # the token budget counts drafts
    assert so.scheduled_spec_decode_tokens == {"a": [11, 12, 13]}
    assert req.spec_token_ids == []  # the next ones come after this step
    # KV slots for all 6 + 4 tokens the step wrote: 3 blocks of 4.
    assert len(sched.kv_cache_manager.get_block_ids("a")[0]) == -(-(6 + 1 + K) // BS)
    # Two drafts rejected: computed goes back by 2, to just before the last token.
    assert req.output_token_ids == [7, 11, 99]
    assert req.num_computed_tokens == 10 - 2 == req.num_tokens - 1
    (out,) = outputs[0].outputs
    assert (out.new_token_ids, out.num_draft_tokens, out.num_accepted_tokens) == ([11, 99], 3, 1)
    stats = outputs[0].scheduler_stats
    assert stats is not None and stats.spec_decoding_stats is not None
    spec = stats.spec_decoding_stats
    assert (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) == (1, 3, 1)
    assert spec.num_accepted_tokens_per_pos == [1, 0, 0]
    check_blocks(sched)

    # All kept: the bonus too, and nothing to roll back.
    propose(sched, {"a": [21, 22, 23]})
    emit(sched, {"a": [21, 22, 23, 24]})
    assert req.num_computed_tokens == req.num_tokens - 1
    check_blocks(sched)


def test_budget_and_max_model_len_cut_the_drafts() -> None:
    sched = spec_scheduler(max_num_batched_tokens=3)
    a = make_request("a", 3, max_tokens=20)
    sched.add_request(a)
    emit(sched, {"a": [7]})
    propose(sched, {"a": [11, 12, 13]})
    so, _ = emit(sched, {"a": [11, 12, 5]})
    assert so.num_scheduled_tokens == {"a": 3}
    assert so.scheduled_spec_decode_tokens == {"a": [11, 12]}
    assert a.num_computed_tokens == a.num_tokens - 1

    # Two tokens short of max_model_len 16: only one draft fits.
    sched = spec_scheduler(max_model_len=16)
    b = make_request("b", 13, max_tokens=2)
    sched.add_request(b)
    emit(sched, {"b": [7]})
    propose(sched, {"b": [11, 12, 13]})
    so, _ = emit(sched, {"b": [11, 5]})
    assert so.scheduled_spec_decode_tokens == {"b": [11]}


def test_draft_model_reserves_lookahead_slots() -> None:
    """A draft model writes its own k drafts past the step's tokens."""
    sched = spec_scheduler(method="draft_model")
    req = make_request("a", 6, max_tokens=20)
    sched.add_request(req)
    emit(sched, {"a": [7]})
    assert len(sched.kv_cache_manager.get_block_ids("a")[0]) == -(-(6 + K) // BS)
    propose(sched, {"a": [11, 12, 13]})
    emit(sched, {"a": [11, 12, 13, 14]})
    assert len(sched.kv_cache_manager.get_block_ids("a")[0]) == -(-(6 + 1 + K + K) // BS)
    check_blocks(sched)


def test_prefill_chunk_and_preempted_requests_get_no_drafts() -> None:
    sched = spec_scheduler(max_num_batched_tokens=4)
    req = make_request("a", 6, max_tokens=20)
    sched.add_request(req)
    emit(sched, {})  # 4 of 6 prompt tokens
    propose(sched, {"a": [1, 2, 3]})
    assert req.spec_token_ids == []
    emit(sched, {"a": [7]})
    propose(sched, {"a": [1, 2, 3]})
    assert req.spec_token_ids == [1, 2, 3]
    sched._preempt_request(sched.running.pop(), 0.0)
    assert req.spec_token_ids == []
    assert req.num_tokens_with_spec == req.num_tokens


@pytest.mark.parametrize(
    "kwargs, emitted, kept",
    [
        ({}, [11, EOS, 13, 14], [11, EOS]),  # EOS in the middle of the run
        ({"stop_token_ids": [12]}, [11, 12, 13, 14], [11, 12]),
        ({"max_tokens": 3}, [11, 12, 13, 14], [11, 12]),  # 7 + two = max_tokens
    ],
    ids=["eos", "stop-token", "max-tokens"],
)
def test_a_stop_in_the_middle_of_an_accepted_run_cuts_it(
    kwargs: dict, emitted: list[int], kept: list[int]
) -> None:
    sched = spec_scheduler()
    req = make_request("a", 6, **{"max_tokens": 20, **kwargs})
    sched.add_request(req)
    emit(sched, {"a": [7]})
    propose(sched, {"a": emitted[:-1]})
    _, outputs = emit(sched, {"a": emitted})
    (out,) = outputs[0].outputs
    assert out.new_token_ids == kept
    assert out.finish_reason is not None
    assert req.output_token_ids == [7, *kept]
    assert "a" not in sched.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks
    check_blocks(sched)


# ------------------------------------------------------------------ bad input
def _target(vocab_size: int = 100) -> ModelConfig:
    return ModelConfig(
        model="fake",
        hf_config={"architectures": ["LlamaForCausalLM"], "vocab_size": vocab_size},
    )


@pytest.mark.parametrize(
    "config, message",
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "Unsupported speculative method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens .*\[1, 128\]"),
        ({"method": "ngram"}, "needs num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2.5}, "needs num_speculative_tokens"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
             "prompt_lookup_max": 2},
            "prompt_lookup_min=4 must be <= prompt_lookup_max=2",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, ">= 1"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs a model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "k": 3}, r"unknown keys \['k'\]"),
        (
            {"method": "draft_model", "model": "d", "num_speculative_tokens": 2,
             "draft_sample_method": "top"},
            "draft_sample_method",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "draft_sample_method": "top"},
            "draft_sample_method",
        ),
        ({"method": "draft_model", "model": "ngram", "num_speculative_tokens": 2}, "needs a model"),
        ({"method": "draft_model", "model": 123, "num_speculative_tokens": 2}, "must be a path"),
    ],
)  # fmt: skip
def test_bad_speculative_configs_are_refused(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(config, _target())


def test_ngram_defaults_and_method_inference() -> None:
    config = SpeculativeConfig.from_dict({"num_speculative_tokens": 2}, _target())
    assert (config.method, config.prompt_lookup_min, config.prompt_lookup_max) == ("ngram", 5, 5)
    config = SpeculativeConfig.from_dict(
        {"model": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, _target()
    )
    assert (config.method, config.prompt_lookup_min) == ("ngram", 3)


def test_the_cli_takes_a_json_speculative_config(capsys: pytest.CaptureFixture[str]) -> None:
    """--speculative-config '{...}' (vLLM's flag), also forwarded by trace --serve."""
    import argparse

    from tracevllm.engine.arg_utils import EngineArgs
    from tracevllm.entrypoints.trace_serve import engine_flags

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", '
                              '"num_speculative_tokens": 4, "prompt_lookup_max": 3}'])  # fmt: skip
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.speculative_config == config
    flags = engine_flags(engine_args)
    assert EngineArgs.from_cli_args(parser.parse_args(flags)).speculative_config == config
    for bad in ("{method: ngram}", "[1, 2]"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--speculative-config", bad])
    assert "--speculative-config" in capsys.readouterr().err


def test_serve_refuses_a_bad_speculative_config_by_name() -> None:
    import asyncio

    from tracevllm.entrypoints.cli import make_parser
    from tracevllm.entrypoints.openai.api_server import run_server

    config = '{"method": "ngram", "num_speculative_tokens": "four"}'
    args = make_parser().parse_args(["serve", "--speculative-config", config])
    with pytest.raises(ValueError, match="needs num_speculative_tokens"):
        asyncio.run(run_server(args))


def test_the_grammar_walks_through_the_drafts_even_without_asserts() -> None:
    """grammar_bitmask advances the matcher through each draft to fill the
    next row, then rolls it back; under ``python -O`` (asserts stripped) it
    must do the same."""
    import subprocess
    import sys

    code = """
import types, torch
from tracevllm.structured_output import StructuredOutputManager

class Grammar:  # its state: how many tokens it took; a row holds the state
    n = 0
    def is_terminated(self): return False
    def fill_bitmask(self, bitmask, i): bitmask[i].fill_(self.n)
    def accept_tokens(self, req_id, tokens): self.n += len(tokens); return True
    def rollback(self, k): self.n -= k

manager = StructuredOutputManager.__new__(StructuredOutputManager)
manager._grammar_bitmask = torch.zeros(4, 1, dtype=torch.int32)
grammar = Grammar()
request = types.SimpleNamespace(structured_output_request=types.SimpleNamespace(grammar=grammar))
rows = manager.grammar_bitmask({"a": request}, ["a"], {"a": [5, 6]})
print(rows[:, 0].tolist(), grammar.n)
"""
    for flags in ([], ["-O"]):
        result = subprocess.run(
            [sys.executable, *flags, "-c", code], capture_output=True, text=True, check=True
        )
        assert result.stdout.split("\n")[-2] == "[0, 1, 2] 0", (flags, result.stdout)
