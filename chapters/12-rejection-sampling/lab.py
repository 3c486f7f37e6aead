"""Lab 12: the acceptance rule of speculative decoding. Your version of
``tracevllm.sample.rejection_sampler.accept_draft_tokens``.

Read README.md first. Test it with ``make lab CH=12``; watch it verify real
drafts with ``TRACEVLLM_LAB=12 .venv/bin/tracevllm trace --prompt "..."
--speculative-config '{"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_min": 2, "prompt_lookup_max": 4}'``.
"""

from __future__ import annotations


def accept_draft_tokens(
    draft_token_ids: list[int],  # the request's k drafts
    bonus_token_id: int,  # sampled from p after the last draft
    is_greedy: bool,
    target_argmax: list[int],  # greedy: p's argmax at each draft position
    target_probs: list[float] | None,  # random: p(draft) at each position
    draft_probs: list[float] | None,  # random: q(draft); None: an n-gram draft (q = 1)
    uniform_probs: list[float] | None,  # random: u ~ U[0, 1) per position
    recovered_token_ids: list[int] | None,  # random: drawn from norm(max(p - q, 0))
) -> list[int]:
    """One request's emitted tokens: its accepted drafts, then one more."""
    # TODO 1: walk the drafts in order; stop at the first one rejected.
    # TODO 2 (greedy): the target's argmax goes out at each position; a draft
    #         that differs from it is rejected (and ends the run).
    # TODO 3 (random): keep the draft when u <= p / q (q = 1 without draft
    #         probabilities; q = 0 rejects); on a rejection the recovered
    #         token goes out instead, and the run ends.
    # TODO 4: every draft kept: the bonus token follows.
    raise NotImplementedError("Lab 12: accept_draft_tokens (see chapters/12-rejection-sampling)")
