"""RMS normalization with the residual add fused in.

Mirrors vllm/model_executor/layers/layernorm.py (``RMSNorm``, a ``CustomOp``
registered as "rms_norm", and ``GemmaRMSNorm``). ``forward_native`` is the
same math in the same order as HF's ``LlamaRMSNorm`` (and ``Gemma2RMSNorm``)
so that results match it; ``forward_cpu`` runs vLLM's two kernels,
``rms_norm`` and ``fused_add_rms_norm`` (kernels/csrc/cpu_ops.cpp): one pass
over each row where the native path takes seven ops, each a pass and a new
tensor. Left out: variance over a subset of the hidden size.
"""

from __future__ import annotations

import torch
from torch import nn

from tracevllm import _custom_ops as ops
from tracevllm.model_executor.custom_op import CustomOp, cpu_kernel_fits


@CustomOp.register("rms_norm")
class RMSNorm(CustomOp):
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

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``x`` alone: normalize it. With ``residual``: add it first, and return
        the sum too, which becomes the next residual (vLLM's fused_add_rms_norm)."""
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    # --8<-- [start:rms_norm_forward_cpu]
    def forward_cpu(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """As ``forward_native``; with ``residual``, in place as vLLM's kernel:
        ``residual`` becomes the sum and ``x`` its norm."""
        if not cpu_kernel_fits(x, residual, self.weight.data.unsqueeze(0)):
            return self.forward_native(x, residual)
        if residual is None:
            out = torch.empty_like(x)
            ops.rms_norm(out, x, self.weight.data, self.variance_epsilon)
            return out
        ops.fused_add_rms_norm(x, residual, self.weight.data, self.variance_epsilon)
        return x, residual

    # --8<-- [end:rms_norm_forward_cpu]


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
