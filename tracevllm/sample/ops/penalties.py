"""Penalties for the sampler: the generated tokens as a tensor, then the penalties.

Mirrors vllm/v1/sample/ops/penalties.py (``apply_all_penalties``,
``_convert_to_tensors``). The prompt tokens come from the persistent batch as
a padded tensor; the generated ones are the runner's growing Python lists,
padded here each step. Left out: the -1 placeholders of async scheduling.
"""

from __future__ import annotations

import torch

from tracevllm.model_executor.layers.utils import apply_penalties


def apply_all_penalties(
    logits: torch.Tensor,  # [num_reqs, vocab_size]
    prompt_token_ids: torch.Tensor,  # [num_reqs, max_prompt_len], padded with vocab_size
    presence_penalties: torch.Tensor,  # [num_reqs]
    frequency_penalties: torch.Tensor,  # [num_reqs]
    repetition_penalties: torch.Tensor,  # [num_reqs]
    output_token_ids: list[list[int]],  # per request, the tokens generated so far
) -> torch.Tensor:
    """Presence, frequency and repetition penalties on ``logits``, in place."""
    _, vocab_size = logits.shape
    output_tokens_t = _convert_to_tensors(output_token_ids, vocab_size, logits.device)
    return apply_penalties(
        logits,
        prompt_token_ids,
        output_tokens_t,
        presence_penalties,
        frequency_penalties,
        repetition_penalties,
    )


def _convert_to_tensors(
    output_token_ids: list[list[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """[num_reqs, longest output] int64, padded with ``vocab_size`` (no token has that id)."""
    max_len = max((len(ids) for ids in output_token_ids), default=0)
    padded = torch.full((len(output_token_ids), max_len), vocab_size, dtype=torch.int64)
    for row, ids in enumerate(output_token_ids):
        padded[row, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
    return padded.to(device)
