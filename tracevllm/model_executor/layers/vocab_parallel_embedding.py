"""Token embedding and LM head.

Mirrors vllm/model_executor/layers/vocab_parallel_embedding.py
(``VocabParallelEmbedding``, ``ParallelLMHead``) without the vocabulary
sharding across tensor-parallel ranks or the padding of the vocabulary to a
multiple of 64. Weights start empty: the loader fills them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tracevllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # [num_tokens] -> [num_tokens, embedding_dim]
        return F.embedding(input_ids, self.weight)

    def process_weights_after_loading(self) -> None:
        """Pack the weight for the LM head's matmul too (vLLM: in
        ``UnquantizedEmbeddingMethod``); the embedding keeps the plain copy."""
        dispatch_cpu_unquantized_gemm(self, remove_weight=False)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection: ``hidden @ weight.T`` gives the logits.

    Its weight has the embedding's shape, so a model with tied embeddings
    uses ``embed_tokens`` itself as the LM head.
    """

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("LMHead's weights should be used in the logits computation.")
