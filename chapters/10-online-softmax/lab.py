"""Lab 10: the online softmax. Your version of
``kernels.flash_attention.blocked_attention``.

Read README.md first. Test it with ``make lab CH=10``. The engine's CPU path
never calls this function (it attends through PyTorch's SDPA): the online
softmax is what the Triton kernels run on a GPU, and what this lab has you
write once, in PyTorch.
"""

from __future__ import annotations

import torch


def blocked_attention(
    q: torch.Tensor,  # [batch, num_heads, q_len, head_size]
    k: torch.Tensor,  # [batch, num_kv_heads, kv_len, head_size]
    v: torch.Tensor,  # [batch, num_kv_heads, kv_len, head_size]
    causal: bool = True,
    scale: float | None = None,
    block_m: int = 64,
    block_n: int = 64,
) -> torch.Tensor:  # [batch, num_heads, q_len, head_size]
    """Attention one [block_m, block_n] tile of scores at a time."""
    # TODO 1: scale defaults to head_size ** -0.5. GQA: query head h reads KV
    #         head h // (num_heads // num_kv_heads).
    # TODO 2: causal with kv_len >= q_len: query i sits at position
    #         kv_len - q_len + i and sees keys 0 .. kv_len - q_len + i.
    # TODO 3: for each block of block_m queries, keep per query row a running
    #         max m (start: -inf), a running sum l of exp(score - m) (start: 0)
    #         and a running, unnormalized output acc (start: 0).
    # TODO 4: for each block of block_n keys: scores (masked), the new max
    #         m_new; rescale l and acc by exp(m - m_new); add this block's
    #         exp(score - m_new) to l, and its exp(score - m_new) @ v to acc.
    # TODO 5: after the last key block, the block's output is acc / l.
    #         Never build the whole [q_len, kv_len] score matrix.
    raise NotImplementedError("Lab 10: blocked_attention (see chapters/10-online-softmax)")
