"""The grouped GEMM of a mixture-of-experts layer: each token's rows times its experts' weights.

Mirrors the kernel half of vllm/model_executor/layers/fused_moe/fused_moe.py
(``fused_moe_kernel``, ``invoke_fused_moe_triton_kernel``,
``get_default_config``): a plain-PyTorch reference first, then the Triton
kernel and its launcher, tested against it. The orchestration around them
(routing, ``moe_align_block_size``, the activation, the sum over the top-k)
lives in tracevllm/model_executor/layers/fused_moe/.

One launch computes ``C[t, k] = A[t // top_k] @ B[e].T`` for every row ``t``
of ``sorted_token_ids`` (a flattened (token, k) pair), where ``e`` is the
expert of the row's block: rows come grouped by expert and padded to
``BLOCK_SIZE_M``, so every block of rows meets one expert's weights.

Left out: the quantized variants (fp8, int8, int4/wna16 and their scales),
expert-parallel blocks (``expert_ids == -1``), the bias, split-K, the
"naive" one-token-per-block assignment, and the tuned per-GPU config files
(``get_moe_configs``): the launch always takes ``get_default_config``.
Departure: on fp32 inputs the dot products are IEEE fp32, not TF32 (vLLM
leaves Triton's TF32 default), so the Triton path keeps the engine's
greedy tokens equal to HF's in fp32 as the torch path does; and the output
dtype is read from ``C`` where vLLM passes ``compute_type``.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels.triton_utils import tl, triton


# --8<-- [start:fused_moe_kernel_torch]
def fused_moe_kernel_torch(
    A: torch.Tensor,  # [num_rows, K]: tokens (first GEMM) or (token, k) rows (second)
    B: torch.Tensor,  # [num_experts, N, K]: the stacked expert weights
    C: torch.Tensor,  # [num_tokens, top_k, N]: written at every routed (token, k)
    topk_weights: torch.Tensor,  # [num_tokens, top_k], float32
    sorted_token_ids: torch.Tensor,  # [max_num_tokens_padded], int32 (moe_align_block_size)
    expert_ids: torch.Tensor,  # [max_num_m_blocks], int32: each block's expert
    num_tokens_post_padded: torch.Tensor,  # [1], int32: rows in use, whole blocks
    mul_routed_weight: bool,
    top_k: int,
    config: dict[str, Any],
) -> None:
    """What ``fused_moe_kernel`` computes, expert by expert, in fp32.

    A row of ``sorted_token_ids`` at or past ``A.shape[0] * top_k`` is
    padding (moe_align_block_size's filler) and writes nothing.
    """
    block_m = config["BLOCK_SIZE_M"]
    num_valid_tokens = A.shape[0] * top_k
    n = int(num_tokens_post_padded.item())  # a host sync: fine for a reference
    rows = sorted_token_ids[:n].long()  # [n]
    row_expert = expert_ids[: n // block_m].long().repeat_interleave(block_m)  # [n]
    valid = rows < num_valid_tokens
    rows, row_expert = rows[valid], row_expert[valid]  # [num_valid_tokens]
    out = C.view(-1, C.shape[-1])  # [num_tokens * top_k, N]
    for expert in row_expert.unique().tolist():
        expert_rows = rows[row_expert == expert]  # [rows of this expert]
        # [rows, K] @ [K, N] -> [rows, N], accumulated in fp32 as the kernel does.
        acc = A[expert_rows // top_k].float() @ B[expert].float().T
        if mul_routed_weight:
            acc = acc * topk_weights.view(-1)[expert_rows, None].float()
        out[expert_rows] = acc.to(C.dtype)


# --8<-- [end:fused_moe_kernel_torch]


# --8<-- [start:fused_moe_kernel]
@triton.jit
def fused_moe_kernel(
    a_ptr,  # [num_rows, K]
    b_ptr,  # [num_experts, N, K]
    c_ptr,  # [num_tokens, top_k, N]
    topk_weights_ptr,  # [num_tokens * top_k]
    sorted_token_ids_ptr,  # [EM]
    expert_ids_ptr,  # [EM / BLOCK_SIZE_M]
    num_tokens_post_padded_ptr,  # [1]
    N,
    K,
    EM,  # rows of sorted_token_ids this launch covers
    num_valid_tokens,  # num_tokens * top_k: a sorted id at or past it is padding
    stride_am,
    stride_ak,
    stride_be,
    stride_bk,
    stride_bn,
    stride_cm,  # one (token, k) row of C
    stride_cn,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    top_k: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 (no TF32 rounding), else None: the default
):
    """One ``[BLOCK_SIZE_M, BLOCK_SIZE_N]`` tile of C: a block of rows, all one expert's.

    Grid: ``(cdiv(EM, BLOCK_SIZE_M) * cdiv(N, BLOCK_SIZE_N),)``. Programs are
    numbered in groups of ``GROUP_SIZE_M`` row blocks, column by column, so
    that neighbouring programs share B's tiles in L2 (Triton's matmul
    tutorial). The row block ``pid_m`` reads its rows' token ids (A's rows:
    ``id // top_k``) and its expert from ``expert_ids[pid_m]``, then walks K.
    """
    pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(EM, BLOCK_SIZE_M)
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    num_pid_in_group = GROUP_SIZE_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_SIZE_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_SIZE_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    # Blocks past the padded row count hold no rows: the grid is an upper
    # bound, since the count lives on the device.
    num_tokens_post_padded = tl.load(num_tokens_post_padded_ptr)
    if pid_m * BLOCK_SIZE_M >= num_tokens_post_padded:
        return
    offs_token_id = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M).to(tl.int64)
    # int64: a row id times a stride overflows int32 on a large batch.
    offs_token = tl.load(sorted_token_ids_ptr + offs_token_id).to(tl.int64)  # [BLOCK_SIZE_M]
    token_mask = offs_token < num_valid_tokens
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)

    # Columns wrap around N instead of being masked on load: the wrapped ones
    # are computed and never stored.
    offs_bn = (pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N).to(tl.int64)) % N
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    # [BLOCK_SIZE_M, BLOCK_SIZE_K] and [BLOCK_SIZE_K, BLOCK_SIZE_N] pointers
    a_ptrs = a_ptr + (offs_token[:, None] // top_k * stride_am + offs_k[None, :] * stride_ak)
    b_ptrs = (
        b_ptr + expert * stride_be + (offs_k[:, None] * stride_bk + offs_bn[None, :] * stride_bn)
    )

    accumulator = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
        k_left = K - k * BLOCK_SIZE_K
        a = tl.load(a_ptrs, mask=token_mask[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        accumulator += tl.dot(a, b, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_SIZE_K * stride_ak
        b_ptrs += BLOCK_SIZE_K * stride_bk

    # The router's weight, in fp32, before the one cast to C's dtype.
    if MUL_ROUTED_WEIGHT:
        moe_weight = tl.load(topk_weights_ptr + offs_token, mask=token_mask, other=0)
        accumulator = accumulator * moe_weight[:, None]
    accumulator = accumulator.to(c_ptr.dtype.element_ty)

    offs_cn = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    c_ptrs = c_ptr + stride_cm * offs_token[:, None] + stride_cn * offs_cn[None, :]
    tl.store(c_ptrs, accumulator, mask=token_mask[:, None] & (offs_cn[None, :] < N))


# --8<-- [end:fused_moe_kernel]


# --8<-- [start:invoke_fused_moe_triton_kernel]
def invoke_fused_moe_triton_kernel(
    A: torch.Tensor,  # [num_rows, K]
    B: torch.Tensor,  # [num_experts, N, K]
    C: torch.Tensor,  # [num_tokens, top_k, N]
    topk_weights: torch.Tensor,  # [num_tokens, top_k], float32
    sorted_token_ids: torch.Tensor,  # [max_num_tokens_padded], int32
    expert_ids: torch.Tensor,  # [max_num_m_blocks], int32
    num_tokens_post_padded: torch.Tensor,  # [1], int32
    mul_routed_weight: bool,
    top_k: int,
    config: dict[str, Any],
) -> None:
    """Launch ``fused_moe_kernel``: the Triton twin of ``fused_moe_kernel_torch``."""
    assert topk_weights.stride(1) == 1 and sorted_token_ids.stride(0) == 1
    num_tokens = A.size(0) * top_k
    EM = sorted_token_ids.size(0)
    if A.size(0) < config["BLOCK_SIZE_M"]:
        # vLLM's small-batch bound: each (token, k) meets a distinct expert,
        # so at most num_tokens blocks hold rows; the rest need no program.
        EM = min(EM, num_tokens * config["BLOCK_SIZE_M"])
    grid = (
        triton.cdiv(EM, config["BLOCK_SIZE_M"]) * triton.cdiv(B.size(1), config["BLOCK_SIZE_N"]),
    )
    fused_moe_kernel[grid](
        A,
        B,
        C,
        topk_weights,
        sorted_token_ids,
        expert_ids,
        num_tokens_post_padded,
        B.size(1),
        B.size(2),
        EM,
        num_tokens,
        A.stride(0),
        A.stride(1),
        B.stride(0),
        B.stride(2),
        B.stride(1),
        C.stride(1),
        C.stride(2),
        MUL_ROUTED_WEIGHT=mul_routed_weight,
        top_k=top_k,
        DOT_PRECISION="ieee" if A.dtype == torch.float32 else None,
        **config,
    )


# --8<-- [end:invoke_fused_moe_triton_kernel]


def get_default_config(
    M: int, E: int, N: int, K: int, topk: int, dtype: torch.dtype
) -> dict[str, int]:
    """Tile sizes for ``M`` tokens: vLLM's defaults for unquantized weights.

    Small batches are memory-bound (tall K tiles, small M tiles), large ones
    compute-bound (wide M/N tiles, more warps). ``GROUP_SIZE_M`` > 1 only pays
    when each expert gets many row blocks. vLLM's tuned JSON files per GPU
    and expert shape are left out; ``E``, ``N``, ``K`` and ``dtype`` are kept
    in the signature for them (fp8 picks other tiles in vLLM).
    """
    block_m = 16 if M <= 32 else 32 if M <= 96 else 64 if M <= 512 else 128
    block_n = 64 if M <= 64 else 128
    block_k = 128 if M <= 64 else 64
    return {
        "BLOCK_SIZE_M": block_m,
        "BLOCK_SIZE_N": block_n,
        "BLOCK_SIZE_K": block_k,
        "GROUP_SIZE_M": 16 if M // max(E, 1) > 128 else 1,
        "num_warps": 4 if M <= 128 else 8,
        "num_stages": 4 if M <= 32 else 3,
    }
