"""Gated activations of the fused gate/up projection.

Mirrors vllm/model_executor/layers/activation.py (``SiluAndMul`` and
``GeluAndMul``, their ``forward_native``). Left out: the other activations
and their CUDA kernels.
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


class GeluAndMul(nn.Module):
    """``gelu(x[:, :d]) * x[:, d:]`` where d = x.shape[-1] // 2 (Gemma's MLP).

    ``approximate="tanh"`` is HF's ``gelu_pytorch_tanh``; ``"none"`` the exact erf GELU.
    """

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"Unknown approximate mode: {approximate}")
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        # [num_tokens, 2 * d] -> [num_tokens, d]
        return F.gelu(x[..., :d], approximate=self.approximate) * x[..., d:]

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"
