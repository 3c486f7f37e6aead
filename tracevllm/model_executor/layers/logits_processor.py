"""Hidden states to logits: the LM head's matmul, gathered over the vocabulary shards.

Mirrors vllm/model_executor/layers/logits_processor.py (``LogitsProcessor``).
Each tensor-parallel rank computes the logits of its slice of the vocabulary;
an all-gather puts the slices side by side (every rank gets the full row, as
vLLM's default ``use_all_gather``), the padding past the vocabulary is cut
off, and Gemma-2's soft cap and a model's logit scale are applied. Left out:
``get_top_tokens`` (the vocab-parallel argmax), LoRA's extra vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn

from tracevllm.distributed.communication_op import tensor_model_parallel_all_gather
from tracevllm.model_executor.layers.utils import cpu_unquantized_gemm
from tracevllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding


# --8<-- [start:logits_processor]
class LogitsProcessor(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        org_vocab_size: int | None = None,
        scale: float = 1.0,
        logits_as_input: bool = False,
        soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        self.scale = scale
        self.vocab_size = vocab_size
        # Whether forward's input is logits already (default: hidden states).
        self.logits_as_input = logits_as_input
        self.org_vocab_size = org_vocab_size or vocab_size
        # Gemma-2: logits squashed into (-soft_cap, soft_cap) by tanh.
        self.soft_cap = soft_cap

    def forward(
        self,
        lm_head: VocabParallelEmbedding,
        hidden_states: torch.Tensor,  # [num_sampled, hidden_size]
        embedding_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.logits_as_input:
            logits = hidden_states
        else:
            logits = self._get_logits(hidden_states, lm_head, embedding_bias)
        if self.soft_cap is not None:
            logits = torch.tanh(logits / self.soft_cap) * self.soft_cap
        if self.scale != 1.0:
            logits *= self.scale
        return logits  # [num_sampled, vocab_size]

    def _get_logits(
        self,
        hidden_states: torch.Tensor,
        lm_head: VocabParallelEmbedding,
        embedding_bias: torch.Tensor | None,
    ) -> torch.Tensor:
        # [num_sampled, vocab_size_padded / T]: this rank's slice of the vocabulary.
        logits = cpu_unquantized_gemm(lm_head, hidden_states, lm_head.weight, embedding_bias)
        # [num_sampled, vocab_size_padded]: the slices in rank order.
        logits = tensor_model_parallel_all_gather(logits)
        return logits[..., : self.org_vocab_size]  # the padding cut off

    def extra_repr(self) -> str:
        return (
            f"vocab_size={self.vocab_size}, org_vocab_size={self.org_vocab_size}, "
            f"scale={self.scale}, logits_as_input={self.logits_as_input}"
        )


# --8<-- [end:logits_processor]
