"""Drafts for free: look the next tokens up in the request's own past.

Mirrors vllm/v1/spec_decode/ngram_proposer.py (``NgramProposer.propose``,
``_find_longest_matched_ngram_and_propose_tokens``). If the last few tokens
of a request (an n-gram, ``prompt_lookup_min`` to ``prompt_lookup_max``
long) occurred earlier in its prompt or output, the k tokens that followed
them then are the drafts now. It costs no model run, and it shines when the
output copies the input (editing, quoting, code). vLLM compiles the search
with numba and spreads a large batch over threads; here it is plain Python,
one request after another (a few microseconds per hundred tokens).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from tracevllm.config import VllmConfig


class NgramProposer:
    def __init__(self, vllm_config: VllmConfig) -> None:
        spec = vllm_config.speculative_config
        assert spec is not None and spec.num_speculative_tokens is not None
        assert spec.prompt_lookup_min is not None and spec.prompt_lookup_max is not None
        # The shortest and longest n-gram to match.
        self.min_n = spec.prompt_lookup_min
        self.max_n = spec.prompt_lookup_max
        # Drafts per request (fewer if the match is followed by fewer tokens).
        self.k = spec.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.get_max_model_len()

    # --8<-- [start:ngram_propose]
    def propose(
        self,
        sampled_token_ids: list[list[int]],  # per row: this step's emitted tokens
        num_tokens_no_spec: np.ndarray,  # [num_reqs]: tokens of each row
        token_ids_cpu: np.ndarray,  # [max_num_reqs, max_model_len]
    ) -> list[list[int]]:
        """Drafts per row of the batch; none for a row that emitted nothing
        (a partial prefill) or that is at ``max_model_len``."""
        draft_token_ids: list[list[int]] = []
        for i, sampled_ids in enumerate(sampled_token_ids):
            num_tokens = int(num_tokens_no_spec[i])
            if not sampled_ids or num_tokens >= self.max_model_len:
                draft_token_ids.append([])
                continue
            draft_token_ids.append(
                _find_longest_matched_ngram_and_propose_tokens(
                    token_ids_cpu[i, :num_tokens].tolist(),
                    self.min_n,
                    self.max_n,
                    self.max_model_len,
                    self.k,
                )
            )
        return draft_token_ids

    # --8<-- [end:ngram_propose]

    def load_model(self, *args: object) -> None:
        """No model to load."""


# --8<-- [start:find_longest_matched_ngram]
def _find_longest_matched_ngram_and_propose_tokens(
    origin_tokens: list[int], min_ngram: int, max_ngram: int, max_model_len: int, k: int
) -> list[int]:
    """The (up to) k tokens after the earliest occurrence of the longest
    n-gram, ``min_ngram <= n <= max_ngram``, that ends the context.

    Reversed, the context's suffix becomes a prefix, and "where else does
    this prefix occur" is what the KMP failure function (``lps``) answers in
    one pass: ``lps[i]`` is the longest proper prefix of ``tokens[:i+1]``
    that is also its suffix. Only the first ``max_ngram`` entries are kept,
    since no longer match counts. E.g. ``[1 2 3 4 1 2 3]`` with n in 2..3:
    ``1 2 3`` occurred at 0, so the drafts are ``4 1 2 ...``.
    """
    total_token = len(origin_tokens)
    if total_token < min_ngram:
        return []
    # No draft past max_model_len.
    k = min(k, max_model_len - total_token)
    if k <= 0:
        return []
    tokens = origin_tokens[::-1]
    # No match is longer than the context: a huge prompt_lookup_max costs nothing.
    lps = [0] * min(max_ngram, total_token)
    longest_ngram = 0
    position = 0
    prev_lps = 0  # tokens[:prev_lps] is the longest prefix that ends at i - 1
    i = 1
    while i < total_token:
        if tokens[prev_lps] == tokens[i]:
            prev_lps += 1
            # ">=": among equally long matches, the latest in reversed order,
            # i.e. the earliest in the context.
            if prev_lps >= longest_ngram:
                longest_ngram = prev_lps
                position = i
            if i < max_ngram:
                lps[i] = prev_lps
            if prev_lps == max_ngram:
                # Longer matches do not count: fall back as on a mismatch.
                prev_lps = lps[max_ngram - 1]
            i += 1
        elif prev_lps != 0:
            # Mismatch: try the next shorter prefix that is also a suffix.
            prev_lps = lps[prev_lps - 1]
        else:
            i += 1
    if longest_ngram < min_ngram:
        return []
    # Back to the context's order: the match is
    # origin_tokens[total_token - 1 - position : ... + longest_ngram].
    start_position = total_token - 1 - position + longest_ngram
    k = min(k, total_token - start_position)
    return origin_tokens[start_position : start_position + k]


# --8<-- [end:find_longest_matched_ngram]
