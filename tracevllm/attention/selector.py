"""Choose the attention backend.

Mirrors vllm/v1/attention/selector.py (``get_attn_backend``), which asks the
platform for the best backend for the model and device. Two backends here:
``torch`` (the readable reference, default on CPU) and ``triton`` (kernels/,
default on CUDA).
"""

from __future__ import annotations

import torch

from tracevllm.attention.backends.abstract import AttentionBackend


def get_attn_backend(name: str | None, device: torch.device | str) -> type[AttentionBackend]:
    """Return the backend class for ``name`` ("torch" | "triton" | None: by device)."""
    device_type = torch.device(device).type
    if name is None:
        name = "triton" if device_type == "cuda" else "torch"
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
    raise ValueError(f"Unknown attention backend {name!r}; choose 'torch' or 'triton'.")
