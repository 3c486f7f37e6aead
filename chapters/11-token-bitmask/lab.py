"""Lab 11: the token bitmask. Your version of
``tracevllm.structured_output.utils.apply_token_bitmask_inplace``.

Read README.md first. Test it with ``make lab CH=11``; watch it constrain a
real request with ``TRACEVLLM_LAB=11 .venv/bin/tracevllm trace --prompt "..."
--choice yes,no``.
"""

from __future__ import annotations

import torch


def apply_token_bitmask_inplace(
    logits: torch.Tensor,  # [num_rows, vocab_size], float32
    bitmask: torch.Tensor,  # [num_rows, ceil(vocab_size / 32)], int32
    indices: list[int] | None = None,  # the rows to mask; None: all
) -> None:
    """Set to -inf every logit whose bit is 0 (xgrammar's operation)."""
    # TODO 1: the rows to mask: indices, or every row.
    # TODO 2: unpack each word of those rows into 32 bits, least significant
    #         first (token t is bit t % 32 of word t // 32).
    # TODO 3: keep the first vocab_size bits of each row.
    # TODO 4: set the logits whose bit is 0 to -inf, in place; leave the others.
    raise NotImplementedError("Lab 11: apply_token_bitmask_inplace (see chapters/11-token-bitmask)")
