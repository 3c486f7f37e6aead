"""Write this step's keys and values into the paged KV cache.

Mirrors vllm/v1/attention/ops/triton_reshape_and_cache_flash.py
(``reshape_and_cache_kernel_flash``, ``triton_reshape_and_cache_flash``) and the
CUDA ``reshape_and_cache_flash`` in csrc/cache_kernels.cu: a plain-PyTorch
reference first, then the Triton kernel and its launcher, tested against it.
Left out: fp8 KV caches and their scales, the head-major (``x``-packed) layout,
the per-token-head quantizing and different-K/V-size variants.
"""

from __future__ import annotations

import torch

from kernels.triton_utils import tl, triton


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


# --8<-- [start:reshape_and_cache_kernel_flash]
@triton.jit
def reshape_and_cache_kernel_flash(
    key_ptr,  # [num_tokens, num_kv_heads, head_size]
    value_ptr,  # [num_tokens, num_kv_heads, head_size]
    key_cache_ptr,  # kv_cache[:, 0]: [num_blocks, block_size, num_kv_heads, head_size]
    value_cache_ptr,  # kv_cache[:, 1]: [num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping_ptr,  # [num_tokens]
    key_stride_0,
    key_stride_1,
    key_stride_2,
    value_stride_0,
    value_stride_1,
    value_stride_2,
    block_stride,  # kv_cache.stride(0): one page
    page_stride,  # kv_cache.stride(2): one slot (row) inside a page
    head_stride,  # kv_cache.stride(3)
    dim_stride,  # kv_cache.stride(4)
    num_heads: tl.constexpr,
    head_size: tl.constexpr,
    block_size: tl.constexpr,
    TILE_SIZE: tl.constexpr,  # a power of two
):
    """Copy one token's K and V (all KV heads) into its cache slot.

    Grid: ``(num_tokens, cdiv(num_heads * head_size, TILE_SIZE))``. Program
    ``(t, i)`` moves elements ``[i * TILE_SIZE, (i + 1) * TILE_SIZE)`` of token
    t's ``num_heads * head_size`` values, K and V alike. One token's row is
    small (a few KB), so most launches have one tile per token, and the work
    is spread over tokens: a pure memory copy, addressed through the slot.
    """
    token_idx = tl.program_id(0)
    tile_idx = tl.program_id(1)
    # int64: slot * page_stride overflows int32 in a cache of a few GB.
    slot_idx = tl.load(slot_mapping_ptr + token_idx).to(tl.int64)
    if slot_idx < 0:
        return  # a padding token: it owns no slot
    block_idx = slot_idx // block_size
    block_offset = slot_idx % block_size

    # [TILE_SIZE] positions in the flattened (head, dim) row of this token
    tile_pos = tile_idx * TILE_SIZE + tl.arange(0, TILE_SIZE)
    mask = tile_pos < num_heads * head_size
    head = tile_pos // head_size
    dim = tile_pos % head_size

    src_key = token_idx * key_stride_0 + head * key_stride_1 + dim * key_stride_2
    src_value = token_idx * value_stride_0 + head * value_stride_1 + dim * value_stride_2
    # K and V of a slot share an address inside their halves of the page.
    tgt = block_idx * block_stride + block_offset * page_stride + head * head_stride
    tgt += dim * dim_stride

    key_tile = tl.load(key_ptr + src_key, mask=mask)  # [TILE_SIZE]
    value_tile = tl.load(value_ptr + src_value, mask=mask)  # [TILE_SIZE]
    tl.store(key_cache_ptr + tgt, key_tile, mask=mask)
    tl.store(value_cache_ptr + tgt, value_tile, mask=mask)


# --8<-- [end:reshape_and_cache_kernel_flash]


# --8<-- [start:reshape_and_cache_flash_triton]
def reshape_and_cache_flash_triton(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens], int64; -1 = padding, not written
) -> None:
    """Launch ``reshape_and_cache_kernel_flash``: the Triton twin of the function above.

    vLLM's ``triton_reshape_and_cache_flash`` takes the key and value caches as
    two tensors; here they are the two halves of one page, ``kv_cache[:, 0]``
    and ``kv_cache[:, 1]``, which share every stride.
    """
    num_heads, head_size = key.shape[1], key.shape[2]
    # As the reference: the slot mapping says how many tokens there are (key may be padded).
    num_tokens = slot_mapping.shape[0]
    block_size = kv_cache.shape[2]
    key_cache, value_cache = kv_cache[:, 0], kv_cache[:, 1]
    n = num_heads * head_size
    # vLLM's heuristic: one tile covers a whole token row up to 2048 elements.
    tile_size = min(2048, triton.next_power_of_2(n))
    grid = (num_tokens, triton.cdiv(n, tile_size))
    reshape_and_cache_kernel_flash[grid](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        kv_cache.stride(0),
        kv_cache.stride(2),
        kv_cache.stride(3),
        kv_cache.stride(4),
        num_heads=num_heads,
        head_size=head_size,
        block_size=block_size,
        TILE_SIZE=tile_size,
    )


# --8<-- [end:reshape_and_cache_flash_triton]
