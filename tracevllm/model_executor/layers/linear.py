"""The linear layers: a weight, a bias, and how the matmul is done.

Mirrors vllm/model_executor/layers/linear.py (``ReplicatedLinear``, with
``UnquantizedLinearMethod``'s ``process_weights_after_loading`` and ``apply``
folded in). Without tensor parallelism every linear layer is replicated:
vLLM's ``QKVParallelLinear``, ``MergedColumnParallelLinear`` and
``RowParallelLinear`` all become this one class, and the fused q/k/v and
gate/up weights are filled shard by shard by ``LlamaForCausalLM.load_weights``.
Left out: sharding, quantization methods, weight loaders per shard.
"""

from __future__ import annotations

import torch
from torch import nn

from tracevllm.model_executor.layers.utils import (
    cpu_unquantized_gemm,
    dispatch_cpu_unquantized_gemm,
)


class ReplicatedLinear(nn.Linear):
    """``nn.Linear`` whose matmul is chosen once its weights are loaded."""

    def process_weights_after_loading(self) -> None:
        # vLLM: UnquantizedLinearMethod.process_weights_after_loading.
        # The packed copy replaces the plain one (no second copy in memory).
        dispatch_cpu_unquantized_gemm(self, remove_weight=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [num_tokens, in_features] -> [num_tokens, out_features]
        return cpu_unquantized_gemm(self, x, self.weight, self.bias)
