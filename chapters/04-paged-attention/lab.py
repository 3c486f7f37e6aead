"""Lab 04: the paged attention read. Your version of
``kernels.unified_attention.unified_attention_torch``.

Read README.md first. Test it with ``make lab CH=04``; watch the model attend
through your code with ``TRACEVLLM_LAB=04 make trace PROMPT="..."``.
"""

from __future__ import annotations

import torch


def unified_attention_torch(
    q: torch.Tensor,  # [num_tokens, num_heads, head_size]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_size]
    out: torch.Tensor,  # [num_tokens, num_heads, head_size], written in place
    query_start_loc: torch.Tensor,  # [num_reqs + 1], int32: request r owns [qsl[r], qsl[r+1])
    seq_lens: torch.Tensor,  # [num_reqs], int32: tokens in the cache, this step's included
    max_query_len: int,
    max_seq_len: int,
    block_table: torch.Tensor,  # [num_reqs, max_num_blocks_per_req], int32
    softmax_scale: float,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
) -> None:
    """Causal attention of each request's queries over its paged keys and values.

    ``window_size`` and ``softcap`` are for the sliding-window and soft-capped
    families (Mistral, Gemma-2); a Llama leaves them at their defaults, and so
    may this lab: refuse anything else.
    """
    # For each request r (a simple loop over requests is fine):
    # TODO 1: its queries: q[query_start_loc[r] : query_start_loc[r + 1]], Q of them;
    #         its seq_len L counts every token in the cache, these Q included.
    # TODO 2: gather its keys and values through the block table: the key of
    #         position p is kv_cache[block_table[r, p // block_size], 0,
    #         p % block_size] (index 1 for the value). Read blocks, not tokens.
    # TODO 3: GQA: query head h uses KV head h // (num_heads // num_kv_heads).
    # TODO 4: query i sits at position L - Q + i and sees keys 0 .. L - Q + i
    #         (causal, with the context before this chunk fully visible).
    # TODO 5: softmax(q . k * softmax_scale) . v, written into out's rows of r.
    # (Optional, for the Mistral/Gemma-2 families: a window (W - 1, 0) keeps keys
    #  p - W + 1 .. p; softcap > 0 bends each score s into softcap * tanh(s / softcap).)
    raise NotImplementedError("Lab 04: unified_attention_torch (see chapters/04-paged-attention)")
