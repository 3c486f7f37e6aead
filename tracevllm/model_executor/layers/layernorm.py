"""RMS normalization with the residual add fused in.

Mirrors vllm/model_executor/layers/layernorm.py (``RMSNorm.forward_native``,
``GemmaRMSNorm.forward_native``). vLLM dispatches to a fused CUDA kernel; the
native path below is the same math, in the same order as HF's ``LlamaRMSNorm``
(and ``Gemma2RMSNorm``) so that results match it. Left out: variance over a
subset of the hidden size.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        orig_dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(dim=-1, keepdim=True)  # [num_tokens, 1]
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * x.to(orig_dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``x`` alone: normalize it. With ``residual``: add it first, and return
        the sum too, which becomes the next residual (vLLM's fused_add_rms_norm)."""
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class GemmaRMSNorm(nn.Module):
    """Gemma's RMS norm. Two differences from ``RMSNorm``: the weight is stored
    as an offset from one, ``x * (1 + w)`` (so it starts at zeros), and the
    product is taken in fp32 before going back to the input's dtype (RMSNorm
    casts first, then multiplies)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.variance_epsilon = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        orig_dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(dim=-1, keepdim=True)  # [num_tokens, 1]
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        return (x * (1.0 + self.weight.float())).to(orig_dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """As ``RMSNorm.forward``: with ``residual``, add it first and return the sum."""
        if residual is None:
            return self._norm(x)
        orig_dtype = x.dtype
        # fp16 overflows on Gemma's large activations: vLLM adds in fp32 and
        # keeps the fp32 sum as the residual.
        x = x.float() + residual.float() if orig_dtype == torch.float16 else x + residual
        return self._norm(x).to(orig_dtype), x
