"""Gated activations of the fused gate/up projection.

Mirrors vllm/model_executor/layers/activation.py (``SiluAndMul``, a
``CustomOp`` registered as "silu_and_mul", and ``GeluAndMul``'s
``forward_native``). ``SiluAndMul.forward_cpu`` runs the ``silu_and_mul``
kernel (kernels/csrc/cpu_ops.cpp), one pass where the native path takes two
and a tensor between them. A departure: vLLM 0.22 pins ``SiluAndMul`` to
``forward_native`` on CPU in every mode (compiled, Inductor fuses it) and
calls ``torch.ops._C.silu_and_mul`` on CUDA only; tracevllm's eager default
takes the kernel. Left out: the other activations and their CUDA kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tracevllm import _custom_ops as ops
from tracevllm.model_executor.custom_op import CustomOp, cpu_kernel_fits


@CustomOp.register("silu_and_mul")
class SiluAndMul(CustomOp):
    """``silu(x[:, :d]) * x[:, d:]`` where d = x.shape[-1] // 2."""

    @staticmethod
    def forward_native(x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        # [num_tokens, 2 * d] -> [num_tokens, d]
        return F.silu(x[..., :d]) * x[..., d:]

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        if not cpu_kernel_fits(x):
            return self.forward_native(x)
        out = x.new_empty(x.shape[0], x.shape[1] // 2)
        ops.silu_and_mul(out, x)
        return out


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
