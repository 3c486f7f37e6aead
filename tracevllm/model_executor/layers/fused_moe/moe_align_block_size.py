"""Group the routed (token, k) pairs by expert, each expert's run padded to whole blocks.

Mirrors vllm/model_executor/layers/fused_moe/moe_align_block_size.py
(``moe_align_block_size``) and the CUDA kernel it calls
(``ops.moe_align_block_size``, csrc/moe/moe_align_sum_kernels.cu), written
here in a few torch operations that run on any device without a host sync.
Left out: ``expert_map`` (expert parallelism), ``ignore_invalid_experts``,
and ``batched_moe_align_block_size``.
"""

from __future__ import annotations

import torch


def _round_up(x: int, y: int) -> int:
    return (x + y - 1) // y * y


# --8<-- [start:moe_align_block_size]
def moe_align_block_size(
    topk_ids: torch.Tensor,  # [num_tokens, top_k]: each token's experts
    block_size: int,
    num_experts: int,
    pad_sorted_ids: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the flattened (token, k) ids by expert, each expert's run padded to ``block_size``.

    Returns ``(sorted_token_ids, expert_ids, num_tokens_post_padded)``:
    ``sorted_token_ids[i]`` is a row ``t * top_k + k`` of the flattened
    ``topk_ids``, or ``topk_ids.numel()`` for padding; ``expert_ids[b]`` is
    the expert of rows ``[b * block_size, (b + 1) * block_size)`` (-1 past the
    last used block); ``num_tokens_post_padded[0]`` is how many rows are used.
    An expert with no tokens gets no block. Within an expert, rows keep their
    order (the CUDA kernel's order is the same up to threads racing).

    Example (vLLM's docstring, with experts numbered from 0): ``topk_ids =
    [[1, 2, 3], [0, 1, 3], [0, 2, 3], [0, 1, 2]]``, block_size 4, 4 experts:
    each expert gets 3 of the 12 rows and one padding row (12), so
    ``sorted_token_ids = [3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 11, 12, 2, 5, 8, 12]``
    and ``expert_ids = [0, 1, 2, 3, -1, ...]``.
    """
    numel = topk_ids.numel()
    device = topk_ids.device
    # The most rows the padding can need: every expert one row short of a
    # block (vLLM's bound, and its tighter one when there are fewer rows than experts).
    max_num_tokens_padded = numel + num_experts * (block_size - 1)
    if pad_sorted_ids:
        max_num_tokens_padded = _round_up(max_num_tokens_padded, block_size)
    if numel < num_experts:
        max_num_tokens_padded = min(numel * block_size, max_num_tokens_padded)
    max_num_m_blocks = -(-max_num_tokens_padded // block_size)

    flat = topk_ids.reshape(-1).long()  # [numel]
    counts = torch.bincount(flat, minlength=num_experts)  # [num_experts]
    padded = (counts + block_size - 1) // block_size * block_size  # [num_experts]
    padded_end = padded.cumsum(0)  # [num_experts]: where each expert's run ends
    padded_start = padded_end - padded
    # A stable sort keeps each expert's rows in their original order.
    order = torch.sort(flat, stable=True).indices  # [numel]
    sorted_experts = flat[order]  # [numel]
    # A row's place in its expert's run: its index in the sorted list minus
    # the number of rows of the experts before it.
    rank = torch.arange(numel, device=device) - (counts.cumsum(0) - counts)[sorted_experts]
    sorted_ids = torch.full((max_num_tokens_padded,), numel, dtype=torch.int32, device=device)
    sorted_ids[padded_start[sorted_experts] + rank] = order.to(torch.int32)

    # Block b belongs to the first expert whose run ends past b's first row;
    # past the last run, no expert (-1).
    block_start = torch.arange(max_num_m_blocks, device=device) * block_size  # [max_num_m_blocks]
    expert_ids = torch.searchsorted(padded_end, block_start, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    num_tokens_post_pad = padded_end[-1:].to(torch.int32)  # [1]
    return sorted_ids, expert_ids, num_tokens_post_pad


# --8<-- [end:moe_align_block_size]
