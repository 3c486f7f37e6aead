"""Token embedding and LM head, the vocabulary split across tensor-parallel ranks.

Mirrors vllm/model_executor/layers/vocab_parallel_embedding.py
(``VocabParallelEmbedding``, ``ParallelLMHead``, ``pad_vocab_size``,
``get_masked_input_and_mask``), with ``UnquantizedEmbeddingMethod`` folded in.
The vocabulary is padded to a multiple of 64 and cut into T equal ranges of
rows; rank r holds rows ``[r * V/T, (r + 1) * V/T)`` (padding rows are zero).

- Embedding: each rank looks up the tokens in its range and writes zeros for
  the others; an all-reduce sums the ranks' rows, so each token gets its row
  from the one rank that holds it.
- LM head: each rank computes the logits of its range; ``LogitsProcessor``
  gathers them into the full vocabulary.

Departures: no LoRA-added vocabulary (``org_num_embeddings`` must be the
vocabulary size); the embedding packs no matmul weight (vLLM packs one for
every embedding on CPU; only the LM head runs a matmul). Left out:
quantized embeddings, GGUF.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import Parameter

from tracevllm.distributed.communication_op import tensor_model_parallel_all_reduce
from tracevllm.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from tracevllm.distributed.utils import divide
from tracevllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
from tracevllm.model_executor.utils import set_weight_attrs

DEFAULT_VOCAB_PADDING_SIZE = 64


def pad_vocab_size(vocab_size: int, pad_to: int = DEFAULT_VOCAB_PADDING_SIZE) -> int:
    """``vocab_size`` rounded up to a multiple of ``pad_to``."""
    return ((vocab_size + pad_to - 1) // pad_to) * pad_to


def get_masked_input_and_mask(
    input_: torch.Tensor, vocab_start_index: int, vocab_end_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids made local to this rank's rows (0 where another rank holds
    the token), and where that is the case."""
    vocab_mask = (input_ >= vocab_start_index) & (input_ < vocab_end_index)
    return vocab_mask * (input_ - vocab_start_index), ~vocab_mask


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        params_dtype: torch.dtype | None = None,
        org_num_embeddings: int | None = None,
        padding_size: int = DEFAULT_VOCAB_PADDING_SIZE,
        quant_config: Any = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        if quant_config is not None:
            raise ValueError("tracevllm runs unquantized weights only (quant_config=None).")
        if org_num_embeddings not in (None, num_embeddings):
            raise ValueError("A vocabulary added by LoRA is not supported by tracevllm.")
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.num_embeddings = num_embeddings
        self.org_vocab_size = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_size = padding_size
        self.num_embeddings_padded = pad_vocab_size(num_embeddings, padding_size)
        self.num_embeddings_per_partition = divide(self.num_embeddings_padded, self.tp_size)
        # This rank's token ids: [vocab_start_index, vocab_end_index), the
        # range cut short by the padding on the last rank(s).
        start = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_start_index = min(start, num_embeddings)
        self.vocab_end_index = min(start + self.num_embeddings_per_partition, num_embeddings)
        self.weight = Parameter(
            torch.empty(
                self.num_embeddings_per_partition,
                embedding_dim,
                dtype=params_dtype or torch.get_default_dtype(),
            ),
            requires_grad=False,
        )
        set_weight_attrs(self.weight, {"input_dim": 1, "output_dim": 0})
        set_weight_attrs(self.weight, {"weight_loader": self.weight_loader})

    def weight_loader(self, param: Parameter, loaded_weight: torch.Tensor) -> None:
        """This rank's rows of the ``[vocab_size, dim]`` checkpoint tensor; the
        padding rows after them zero."""
        output_dim = getattr(param, "output_dim", None)
        if output_dim is None:
            assert param.data.shape == loaded_weight.shape
            param.data.copy_(loaded_weight)
            return
        assert loaded_weight.shape[output_dim] == self.org_vocab_size, (
            f"Checkpoint vocabulary {loaded_weight.shape[output_dim]} != {self.org_vocab_size}"
        )
        shard_size = self.vocab_end_index - self.vocab_start_index
        loaded_weight = loaded_weight.narrow(output_dim, self.vocab_start_index, shard_size)
        param.data[:shard_size].copy_(loaded_weight)
        param.data[shard_size:].fill_(0)

    # --8<-- [start:vocab_parallel_embedding_forward]
    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        # [num_tokens] -> [num_tokens, embedding_dim]
        if self.tp_size == 1:
            return F.embedding(input_, self.weight)
        masked_input, input_mask = get_masked_input_and_mask(
            input_, self.vocab_start_index, self.vocab_end_index
        )
        output_parallel = F.embedding(masked_input, self.weight)
        output_parallel.masked_fill_(input_mask.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(output_parallel)

    # --8<-- [end:vocab_parallel_embedding_forward]
    def extra_repr(self) -> str:
        return (
            f"num_embeddings={self.num_embeddings_per_partition}, "
            f"embedding_dim={self.embedding_dim}, org_vocab_size={self.org_vocab_size}, "
            f"num_embeddings_padded={self.num_embeddings_padded}, tp_size={self.tp_size}"
        )


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection: ``hidden @ weight.T`` gives this rank's logits.

    Its weight has the embedding's shape, so with tied embeddings
    (``tie_weights``) it is the embedding's very parameter.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        bias: bool = False,
        params_dtype: torch.dtype | None = None,
        org_num_embeddings: int | None = None,
        padding_size: int = DEFAULT_VOCAB_PADDING_SIZE,
        quant_config: Any = None,
        prefix: str = "",
    ) -> None:
        super().__init__(
            num_embeddings, embedding_dim, params_dtype, org_num_embeddings, padding_size,
            quant_config, prefix,
        )  # fmt: skip
        if bias:
            self.bias = Parameter(
                torch.empty(self.num_embeddings_per_partition, dtype=params_dtype),
                requires_grad=False,
            )
            set_weight_attrs(self.bias, {"output_dim": 0, "weight_loader": self.weight_loader})
        else:
            self.register_parameter("bias", None)

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> ParallelLMHead:
        """Share the embedding's weight (tied embeddings)."""
        self.weight = embed_tokens.weight
        return self

    def process_weights_after_loading(self) -> None:
        """Pack the weight for the logits matmul (vLLM: in
        ``UnquantizedEmbeddingMethod``). The head drops its plain reference;
        a tied embedding keeps its own for the lookups."""
        dispatch_cpu_unquantized_gemm(self, remove_weight=True)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("LMHead's weights should be used in the sampler.")
