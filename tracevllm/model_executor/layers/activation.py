"""SiLU-gated activation of the fused gate/up projection.

Mirrors vllm/model_executor/layers/activation.py (``SiluAndMul.forward_native``).
Left out: the other activations and their CUDA kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """``silu(x[:, :d]) * x[:, d:]`` where d = x.shape[-1] // 2."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        # [num_tokens, 2 * d] -> [num_tokens, d]
        return F.silu(x[..., :d]) * x[..., d:]
