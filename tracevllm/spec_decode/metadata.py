"""Where a step's draft tokens sit in the flat batch, and where their logits are.

Mirrors vllm/v1/spec_decode/metadata.py (``SpecDecodeMetadata``), made by
``ModelRunner._calc_spec_decode_metadata``, or by ``make_dummy`` (vLLM's, for
its profiling runs and tests: the drafts and their counts are real, every
index is 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
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

    @classmethod
    def make_dummy(
        cls, draft_token_ids: list[list[int]], device: torch.device | str
    ) -> SpecDecodeMetadata:
        """Metadata for the given drafts per request, with every logits index 0."""
        batch_size = len(draft_token_ids)
        num_draft_tokens = [len(ids) for ids in draft_token_ids]
        num_tokens = sum(num_draft_tokens)

        def int32(values: list[int] | np.ndarray) -> torch.Tensor:
            return torch.as_tensor(np.asarray(values, dtype=np.int32), device=device)

        return cls(
            draft_token_ids=int32([t for ids in draft_token_ids for t in ids]),
            num_draft_tokens=num_draft_tokens,
            cu_num_draft_tokens=int32(np.cumsum(num_draft_tokens)),
            cu_num_sampled_tokens=int32(np.cumsum([n + 1 for n in num_draft_tokens])),
            target_logits_indices=int32(np.zeros(num_tokens)),
            bonus_logits_indices=int32(np.zeros(batch_size)),
            logits_indices=int32(np.zeros(num_tokens + batch_size)),
        )
