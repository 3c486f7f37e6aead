"""The only door from the engine into ``kernels/``.

Mirrors vllm/_custom_ops.py, which wraps the compiled ``torch.ops._C`` kernels
behind Python functions; the Triton versions mirror the ops that vLLM's
Triton backend calls directly (``triton_reshape_and_cache_flash``,
``unified_attention``, the MoE layer's ``fused_moe_kernel``). Each op takes
``backend``: ``"torch"`` runs the plain-PyTorch reference, ``"triton"`` the
Triton kernel beside it; the attention backend picks one (torch_attn.py,
triton_attn.py), the FusedMoE layer its own. ``cpu_attention_with_kv_cache``
is the C++ kernel the CPU backend (cpu_attn.py) calls for its decodes;
``rms_norm``, ``fused_add_rms_norm``, ``silu_and_mul`` and
``rotary_embedding`` the C++ kernels (kernels/csrc/cpu_ops.cpp) the layers'
``forward_cpu`` calls, with vLLM's arguments, in vLLM's order. Importing this
module does not import Triton: the kernel files get ``triton`` from
kernels/triton_utils.py, which imports it at the first launch of a kernel.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels.cpu_attn import cpu_attention_with_kv_cache as _cpu_attention_with_kv_cache
from kernels.fused_moe import (
    fused_moe_kernel_torch,
    get_default_config,
    invoke_fused_moe_triton_kernel,
)
from kernels.reshape_and_cache_flash import (
    reshape_and_cache_flash_torch,
    reshape_and_cache_flash_triton,
)
from kernels.triton_utils import HAS_TRITON, interpreter_active
from kernels.unified_attention import unified_attention_torch, unified_attention_triton
from tracevllm.labs import lab_override

__all__ = [
    "HAS_TRITON",
    "cpu_attention_with_kv_cache",
    "dispatch_fused_moe_kernel",
    "fused_add_rms_norm",
    "get_default_config",
    "interpreter_active",
    "moe_sum",
    "reshape_and_cache_flash",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "unified_attention",
]

# Lab 04 (chapters/04-paged-attention) can stand in for the paged read.
unified_attention_torch = lab_override("unified_attention_torch", unified_attention_torch)


def reshape_and_cache_flash(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens], int64, -1 = skip
    backend: str = "torch",
) -> None:
    """Write K/V of this step's tokens into their cache slots.

    ``backend="cpu"``: the C++ copy (kernels/csrc/cpu_ops.cpp; fp32, int64 slots).
    """
    if backend == "cpu":
        torch.ops.tracevllm_C.reshape_and_cache_flash(key, value, kv_cache, slot_mapping)
        return
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
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
) -> None:
    """Paged causal attention for a mixed batch of prefill chunks and decodes.

    ``window_size`` is vLLM's ``(W - 1, 0)`` for a sliding window of W tokens,
    ``(-1, -1)`` for none; ``softcap`` > 0 caps the scores (Gemma-2).
    ``seq_threshold_3D`` (Triton only): decode-only batches of at most this
    many requests take the split-softmax launch; None never does.
    """
    args = (q, kv_cache, out, query_start_loc, seq_lens, max_query_len, max_seq_len)
    if backend == "triton":
        unified_attention_triton(
            *args,
            block_table,
            softmax_scale,
            window_size=window_size,
            softcap=softcap,
            seq_threshold_3D=seq_threshold_3D,
        )
    elif window_size[0] >= 0 or softcap > 0:
        unified_attention_torch(
            *args, block_table, softmax_scale, window_size=window_size, softcap=softcap
        )
    else:
        # Lab 04's version takes vLLM's plain causal read only.
        unified_attention_torch(*args, block_table, softmax_scale)


def cpu_attention_with_kv_cache(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_size]
    output: torch.Tensor,  # [num_tokens, num_heads, head_size]
    query_start_loc: torch.Tensor,  # [num_reqs + 1], int32
    seq_lens: torch.Tensor,  # [num_reqs], int32
    scale: float,
    block_table: torch.Tensor,  # [num_reqs, max_num_blocks_per_req], int32
    small_query_limit: int = 0,
) -> None:
    """Paged attention on CPU (vLLM's ``cpu_attention_with_kv_cache``).

    vLLM's op takes the key and value caches apart, and every query, sliding
    windows, soft caps and ALiBi too; this one tracevllm's one-tensor cache,
    the decodes, and the queries of more than one token that attend at most
    ``small_query_limit`` (query token, key) pairs (kernels/csrc/cpu_attn.cpp).
    """
    _cpu_attention_with_kv_cache(
        query, kv_cache, output, query_start_loc, seq_lens, scale, block_table, small_query_limit
    )


# --8<-- [start:layer_ops]
def rms_norm(out: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, epsilon: float) -> None:
    """``out = weight * input / sqrt(mean(input^2) + epsilon)``, row by row."""
    torch.ops.tracevllm_C.rms_norm(out, input, weight, epsilon)


def fused_add_rms_norm(
    input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, epsilon: float
) -> None:
    """In place: ``residual += input``, then ``input = rms_norm(residual)``."""
    torch.ops.tracevllm_C.fused_add_rms_norm(input, residual, weight, epsilon)


def silu_and_mul(out: torch.Tensor, input: torch.Tensor) -> None:
    """``out = silu(input[:, :d]) * input[:, d:]``, d = input.shape[-1] // 2."""
    torch.ops.tracevllm_C.silu_and_mul(out, input)


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens], int64
    query: torch.Tensor,  # [num_tokens, num_heads * head_size], rotated in place
    key: torch.Tensor | None,  # [num_tokens, num_kv_heads * head_size], rotated in place
    head_size: int,
    cos_sin_cache: torch.Tensor,  # [max_position, rot_dim]: cosines, then sines
    is_neox: bool,
) -> None:
    """Turn each head's first rot_dim floats by its token's angles, in place."""
    torch.ops.tracevllm_C.rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)


# --8<-- [end:layer_ops]


def dispatch_fused_moe_kernel(
    A: torch.Tensor,  # [num_rows, K]
    B: torch.Tensor,  # [num_experts, N, K]
    C: torch.Tensor,  # [num_tokens, top_k, N]
    topk_weights: torch.Tensor,  # [num_tokens, top_k]
    sorted_token_ids: torch.Tensor,  # [max_num_tokens_padded]
    expert_ids: torch.Tensor,  # [max_num_m_blocks]
    num_tokens_post_padded: torch.Tensor,  # [1]
    mul_routed_weight: bool,
    top_k: int,
    config: dict[str, Any],
    backend: str = "torch",
) -> None:
    """One expert GEMM over the routed rows (vLLM's ``dispatch_fused_moe_kernel``)."""
    fn = invoke_fused_moe_triton_kernel if backend == "triton" else fused_moe_kernel_torch
    fn(
        A,
        B,
        C,
        topk_weights,
        sorted_token_ids,
        expert_ids,
        num_tokens_post_padded,
        mul_routed_weight,
        top_k,
        config,
    )


def moe_sum(input: torch.Tensor, output: torch.Tensor) -> None:
    """Each token's top_k expert outputs summed: [num_tokens, top_k, H] -> [num_tokens, H]."""
    torch.sum(input, dim=1, out=output)
