"""Lab 01: the scheduler's token budget. Your version of
``tracevllm.core.sched.scheduler.compute_num_new_tokens``.

Read README.md first. Test it with ``make lab CH=01``; watch it schedule real
requests with ``TRACEVLLM_LAB=01 make trace PROMPT="..."``.
"""

from __future__ import annotations


def compute_num_new_tokens(
    num_tokens: int,
    num_computed_tokens: int,
    token_budget: int,
    long_prefill_token_threshold: int,
    max_model_len: int,
    enable_chunked_prefill: bool = True,
) -> int:
    """How many of a request's tokens to schedule this step; 0 means none."""
    # TODO 1: the tokens the request still needs computed (1 for a decode,
    #         the rest of its prompt for a prefill).
    # TODO 2: cut that to long_prefill_token_threshold, but only if the
    #         threshold is > 0 (0 means "no threshold").
    # TODO 3: without chunked prefill, a request that does not fit in the
    #         token_budget gets nothing (return 0): it waits for a later step.
    # TODO 4: cut to the token_budget (this is a chunked prefill).
    # TODO 5: no token may sit at position max_model_len - 1 or later.
    # TODO 6: never return a negative number.
    raise NotImplementedError("Lab 01: compute_num_new_tokens (see chapters/01-token-budget)")
