"""The only door from the engine into ``kernels/``.

Mirrors vllm/_custom_ops.py, which wraps the compiled ``torch.ops._C`` kernels
behind Python functions. Here the kernels are plain PyTorch (kernels/*.py);
a Triton version is chosen by the triton attention backend, not here.
"""

from __future__ import annotations

import torch

from kernels.reshape_and_cache_flash import reshape_and_cache_flash_torch
from kernels.unified_attention import unified_attention_torch


def reshape_and_cache_flash(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens], int64, -1 = skip
) -> None:
    """Write K/V of this step's tokens into their cache slots."""
    reshape_and_cache_flash_torch(key, value, kv_cache, slot_mapping)


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
) -> None:
    """Paged causal attention for a mixed batch of prefill chunks and decodes."""
    unified_attention_torch(
        q,
        kv_cache,
        out,
        query_start_loc,
        seq_lens,
        max_query_len,
        max_seq_len,
        block_table,
        softmax_scale,
    )
