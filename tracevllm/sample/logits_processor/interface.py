"""What a logits processor is: one batch-wide edit of the logits.

Mirrors vllm/v1/sample/logits_processor/interface.py (``LogitsProcessor``).
Departure: vLLM's processors keep their per-row state across steps and edit
it through ``update_state(BatchUpdate)`` when requests join, leave or move
rows; tracevllm rebuilds ``SamplingMetadata`` every step, so a processor is
made each step from the persistent batch's rows and takes that state in its
constructor (no ``update_state``, no ``BatchUpdate``, no ``validate_params``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class LogitsProcessor(ABC):
    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Edit ``logits`` ([num_reqs, vocab_size], one row per request); may work in place."""
        raise NotImplementedError

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if the processor never changes a row's argmax, so greedy rows skip it."""
        raise NotImplementedError

    def apply_with_spec_decode(
        self, logits: torch.Tensor, num_draft_tokens: list[int]
    ) -> torch.Tensor:
        """The same edit on the rows that verify drafts: request i owns
        ``num_draft_tokens[i]`` consecutive rows, the j-th for its j-th draft
        (vLLM has this for min-tokens only; see the builtins)."""
        raise NotImplementedError
