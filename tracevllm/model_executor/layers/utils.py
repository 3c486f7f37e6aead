"""Penalties on the logits: repetition (CTRL, as in HF), frequency and presence (OpenAI).

Mirrors vllm/model_executor/layers/utils.py (``get_token_bin_counts_and_mask``,
``apply_penalties``); ``apply_repetition_penalties`` is the plain-PyTorch
version of the op vLLM reaches through vllm/_custom_ops.py. Left out: the GEMM
dispatch helpers that share vLLM's file.
"""

from __future__ import annotations

import torch


def get_token_bin_counts_and_mask(
    tokens: torch.Tensor,  # [num_seqs, max_len], int64, padded with vocab_size
    vocab_size: int,
    num_seqs: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """How often each token occurs in each row, and whether it occurs at all.

    The padding id ``vocab_size`` lands in an extra last column, which is
    dropped: padding counts as nothing.
    """
    # [num_seqs, vocab_size + 1]
    bin_counts = torch.zeros((num_seqs, vocab_size + 1), dtype=torch.long, device=tokens.device)
    bin_counts.scatter_add_(1, tokens, torch.ones_like(tokens))
    bin_counts = bin_counts[:, :vocab_size]  # [num_seqs, vocab_size]
    return bin_counts, bin_counts > 0


# --8<-- [start:apply_repetition_penalties]
def apply_repetition_penalties(
    logits: torch.Tensor,  # [num_seqs, vocab_size], modified in place
    prompt_mask: torch.Tensor,  # [num_seqs, vocab_size], bool: in the prompt
    output_mask: torch.Tensor,  # [num_seqs, vocab_size], bool: generated so far
    repetition_penalties: torch.Tensor,  # [num_seqs]
) -> None:
    """Push every token already seen (prompt or output) toward "less likely".

    A penalty p > 1 divides a positive logit by p and multiplies a negative one
    by p (the CTRL paper's rule, HF's ``RepetitionPenaltyLogitsProcessor``):
    either way the token loses ground, whatever its sign.
    """
    seen = prompt_mask | output_mask
    # [num_seqs, vocab_size]: p where seen, 1 elsewhere
    penalties = torch.where(seen, repetition_penalties.unsqueeze(1), 1.0)
    logits *= torch.where(logits > 0, 1.0 / penalties, penalties)


# --8<-- [end:apply_repetition_penalties]


# --8<-- [start:apply_penalties]
def apply_penalties(
    logits: torch.Tensor,  # [num_seqs, vocab_size]
    prompt_tokens_tensor: torch.Tensor,  # [num_seqs, max_prompt_len], padded with vocab_size
    output_tokens_tensor: torch.Tensor,  # [num_seqs, max_output_len], padded with vocab_size
    presence_penalties: torch.Tensor,  # [num_seqs]
    frequency_penalties: torch.Tensor,  # [num_seqs]
    repetition_penalties: torch.Tensor,  # [num_seqs]
) -> torch.Tensor:
    """Repetition, then frequency and presence penalties, in place; returns ``logits``.

    Frequency and presence follow the OpenAI API: ``logit -= frequency *
    count + presence * (count > 0)``, counting generated tokens only (the
    repetition penalty also counts the prompt's).
    """
    num_seqs, vocab_size = logits.shape
    _, prompt_mask = get_token_bin_counts_and_mask(prompt_tokens_tensor, vocab_size, num_seqs)
    output_bin_counts, output_mask = get_token_bin_counts_and_mask(
        output_tokens_tensor, vocab_size, num_seqs
    )
    apply_repetition_penalties(logits, prompt_mask, output_mask, repetition_penalties)
    logits -= frequency_penalties.unsqueeze(1) * output_bin_counts
    logits -= presence_penalties.unsqueeze(1) * output_mask
    return logits


# --8<-- [end:apply_penalties]
