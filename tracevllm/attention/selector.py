"""Choose the attention backend.

Mirrors vllm/v1/attention/selector.py (``get_attn_backend``), which asks the
platform for the best backend for the model and device. Three backends here:
``cpu_attn`` (vLLM's CPU_ATTN: decodes and short prompts through a C++
kernel, the default on CPU when it builds), ``torch`` (the readable reference, the CPU default
without a compiler) and ``triton`` (kernels/, default on CUDA).
"""

from __future__ import annotations

import torch

from kernels.cpu_attn import cpu_kernels_available
from tracevllm.attention.backends.abstract import AttentionBackend


def get_attn_backend(name: str | None, device: torch.device | str) -> type[AttentionBackend]:
    """Return the backend class for ``name`` ("cpu_attn" | "torch" | "triton" | None: by device)."""
    device_type = torch.device(device).type
    if name is None:
        if device_type == "cuda":
            name = "triton"
        else:
            name = "cpu_attn" if cpu_kernels_available() else "torch"
    if name == "cpu_attn":
        if device_type != "cpu":
            raise ValueError(f"attention_backend 'cpu_attn' runs on CPU only, not {device_type}.")
        if not cpu_kernels_available():
            raise ValueError(
                "attention_backend 'cpu_attn': its kernel could not be built (see the warning "
                "above); install g++ and ninja, or choose 'torch'."
            )
        from tracevllm.attention.backends.cpu_attn import CPUAttentionBackend

        return CPUAttentionBackend
    if name == "torch":
        from tracevllm.attention.backends.torch_attn import TorchAttentionBackend

        return TorchAttentionBackend
    if name == "triton":
        from tracevllm.attention.backends.triton_attn import (
            TritonAttentionBackend,
            check_triton_usable,
        )

        check_triton_usable(device_type)
        return TritonAttentionBackend
    raise ValueError(f"Unknown attention backend {name!r}; choose 'cpu_attn', 'torch' or 'triton'.")
