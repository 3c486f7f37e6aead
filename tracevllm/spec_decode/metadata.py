"""Where a step's draft tokens sit in the flat batch, and where their logits are.

Mirrors vllm/v1/spec_decode/metadata.py (``SpecDecodeMetadata``), made by
``ModelRunner._calc_spec_decode_metadata``. Left out: ``make_dummy`` (for
profiling runs, which tracevllm has none of).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class SpecDecodeMetadata:
    """E.g. three requests with [3, 0, 2] drafts, scheduled [4, 100, 3] tokens:
    logits_indices [0 1 2 3 103 104 105 106], target [0 1 2 5 6], bonus [3 4 7]."""

    # [num_draft_tokens], int32: every request's drafts, one after the other.
    draft_token_ids: torch.Tensor
    # [batch_size]: drafts per request (0 for a request without).
    num_draft_tokens: list[int]
    # [batch_size], int32: cumsum of num_draft_tokens.
    cu_num_draft_tokens: torch.Tensor
    # [batch_size], int32: cumsum of num_draft_tokens + 1 (one bonus each).
    cu_num_sampled_tokens: torch.Tensor
    # [num_draft_tokens], into the rows of logits: the logits that verify each draft.
    target_logits_indices: torch.Tensor
    # [batch_size], into the rows of logits: the logits after each request's last token.
    bonus_logits_indices: torch.Tensor
    # [num_draft_tokens + batch_size], into the flat batch: the tokens whose logits are computed.
    logits_indices: torch.Tensor
    max_spec_len: int = field(init=False)

    def __post_init__(self) -> None:
        self.max_spec_len = max(self.num_draft_tokens)
