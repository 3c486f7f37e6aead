"""The only door from the engine into ``kernels/``.

Mirrors vllm/_custom_ops.py, which wraps the compiled ``torch.ops._C`` kernels
behind Python functions; the Triton versions mirror the ops that vLLM's
Triton backend calls directly (``triton_reshape_and_cache_flash``,
``unified_attention``). Each op takes ``backend``: ``"torch"`` runs the
plain-PyTorch reference, ``"triton"`` the Triton kernel beside it; the
attention backend picks one (torch_attn.py, triton_attn.py). Importing this
module does not import Triton: the kernel files get ``triton`` from
kernels/triton_utils.py, which imports it at the first launch of a kernel.
"""

from __future__ import annotations

import torch

from kernels.reshape_and_cache_flash import (
    reshape_and_cache_flash_torch,
    reshape_and_cache_flash_triton,
)
from kernels.triton_utils import HAS_TRITON, interpreter_active
from kernels.unified_attention import unified_attention_torch, unified_attention_triton
from tracevllm.labs import lab_override

__all__ = ["HAS_TRITON", "interpreter_active", "reshape_and_cache_flash", "unified_attention"]

# Lab 04 (chapters/04-paged-attention) can stand in for the paged read.
unified_attention_torch = lab_override("unified_attention_torch", unified_attention_torch)


def reshape_and_cache_flash(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens], int64, -1 = skip
    backend: str = "torch",
) -> None:
    """Write K/V of this step's tokens into their cache slots."""
    fn = reshape_and_cache_flash_triton if backend == "triton" else reshape_and_cache_flash_torch
    fn(key, value, kv_cache, slot_mapping)


def unified_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_size]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_size]
    out: torch.Tensor,  # [num_tokens, num_heads, head_size]
    query_start_loc: torch.Tensor,  # [num_reqs + 1]
    seq_lens: torch.Tensor,  # [num_reqs]
    max_query_len: int,
    max_seq_len: int,
    block_table: torch.Tensor,  # [num_reqs, max_num_blocks_per_req]
    softmax_scale: float,
    backend: str = "torch",
    seq_threshold_3D: int | None = None,
) -> None:
    """Paged causal attention for a mixed batch of prefill chunks and decodes.

    ``seq_threshold_3D`` (Triton only): decode-only batches of at most this
    many requests take the split-softmax launch; None never does.
    """
    args = (q, kv_cache, out, query_start_loc, seq_lens, max_query_len, max_seq_len)
    if backend == "triton":
        unified_attention_triton(
            *args, block_table, softmax_scale, seq_threshold_3D=seq_threshold_3D
        )
    else:
        unified_attention_torch(*args, block_table, softmax_scale)
