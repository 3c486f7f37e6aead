"""Write this step's keys and values into the paged KV cache.

Mirrors vllm/v1/attention/ops/triton_reshape_and_cache_flash.py (and the CUDA
``reshape_and_cache_flash`` in csrc/cache_kernels.cu), as plain PyTorch. Left
out: fp8 KV caches and their scales.
"""

from __future__ import annotations

import torch


# --8<-- [start:reshape_and_cache_flash_torch]
def reshape_and_cache_flash_torch(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens], int64; -1 = padding, not written
) -> None:
    """Scatter token t's K/V into block ``slot // block_size``, row ``slot % block_size``.

    The slot was computed by the model runner from the block table, so this
    kernel never sees a block table: the page table lives one level up.
    """
    block_size = kv_cache.shape[2]
    num_tokens = slot_mapping.shape[0]
    # The runner may pad the batch; padded tokens carry slot -1.
    valid = slot_mapping[:num_tokens] >= 0  # [num_tokens]
    slots = slot_mapping[valid]  # [num_valid]
    block_idx = slots // block_size  # [num_valid]
    block_offset = slots % block_size  # [num_valid]
    # Indexing with two tensors writes in place through the strided views.
    kv_cache[block_idx, 0, block_offset] = key[:num_tokens][valid]
    kv_cache[block_idx, 1, block_offset] = value[:num_tokens][valid]


# --8<-- [end:reshape_and_cache_flash_torch]
