"""Paged attention over a mixed batch of prefill chunks and decodes.

Mirrors vllm/v1/attention/ops/triton_unified_attention.py (``unified_attention``)
as plain PyTorch: one call serves every request of the step, whatever its
query length, reading K/V through the block table. Left out: sliding windows,
ALiBi, soft-capping, attention sinks, fp8 descales, and the 3D split-softmax
variant for long decodes (a GPU occupancy trick; the math is the same).

The Triton kernel walks the block table inside the kernel, one tile of keys at
a time, with an online softmax. Here the same data flow is spelled with
gathers and ``scaled_dot_product_attention``, in two groups:

- decodes (query length 1): gathered for all of them at once into a padded
  ``[num_decodes, max_seq_len, ...]`` tensor and attended to in one SDPA call,
  with a mask for the padding past each request's ``seq_len``;
- prefill chunks (query length > 1): one SDPA call each, causal with the
  query offset ``seq_len - query_len`` (the chunk sees everything before it).

Padding a long prefill chunk and many decodes into one tensor would multiply
the work by the batch size; two groups keep the work proportional to the tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _gather_kv(
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_size]
    block_table: torch.Tensor,  # [num_reqs, num_blocks_per_req], int32
    num_blocks: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read the first ``num_blocks`` pages of each row into contiguous K and V."""
    _, _, block_size, num_kv_heads, head_size = kv_cache.shape
    num_reqs = block_table.shape[0]
    blocks = block_table[:, :num_blocks].long()  # [num_reqs, num_blocks]
    key = kv_cache[:, 0][blocks]  # [num_reqs, num_blocks, block_size, num_kv_heads, head_size]
    value = kv_cache[:, 1][blocks]  # [num_reqs, num_blocks, block_size, num_kv_heads, head_size]
    shape = (num_reqs, num_blocks * block_size, num_kv_heads, head_size)
    # -> [num_reqs, num_kv_heads, num_blocks * block_size, head_size]
    return key.view(shape).transpose(1, 2), value.view(shape).transpose(1, 2)


# --8<-- [start:unified_attention_torch]
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
) -> None:
    """Causal attention of each request's queries over its paged keys and values.

    Query token i of a request with ``seq_len`` L and query length Q sits at
    position L - Q + i and sees keys 0 .. L - Q + i. GQA: query head h reads KV
    head h // (num_heads // num_kv_heads). ``max_query_len`` and ``max_seq_len``
    size the GPU kernel's grid; the loops here find their own bounds.
    """
    block_size = kv_cache.shape[2]
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    num_reqs = len(lens)
    query_lens = [qsl[r + 1] - qsl[r] for r in range(num_reqs)]

    decodes = [r for r in range(num_reqs) if query_lens[r] == 1]
    if decodes:
        # One padded gather and one SDPA call for every single-token query.
        num_decodes, num_heads, head_size = len(decodes), q.shape[1], q.shape[2]
        num_kv_heads = kv_cache.shape[3]
        idx = torch.tensor(decodes, dtype=torch.long, device=q.device)  # [num_decodes]
        max_len = max(lens[r] for r in decodes)
        num_blocks = -(-max_len // block_size)
        key, value = _gather_kv(kv_cache, block_table[idx], num_blocks)
        tok = query_start_loc.to(torch.long)[idx]  # [num_decodes]: each decode's token
        # GQA without copying K/V: the query heads that share a KV head become
        # that head's query rows. [num_decodes, num_heads, head_size] ->
        # [num_decodes, num_kv_heads, num_heads // num_kv_heads, head_size]
        query = q[tok].view(num_decodes, num_kv_heads, -1, head_size)
        key_pos = torch.arange(num_blocks * block_size, device=q.device)  # [max_kv_len]
        padding = key_pos[None, :] >= seq_lens.to(torch.long)[idx][:, None]
        # [num_decodes, 1, 1, max_kv_len]: -inf on the padding past each seq_len
        mask = torch.zeros(padding.shape, dtype=q.dtype, device=q.device)
        mask = mask.masked_fill_(padding, float("-inf"))[:, None, None, :]
        o = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=softmax_scale)
        out[tok] = o.reshape(num_decodes, num_heads, head_size)

    for r in range(num_reqs):
        q_len, seq_len = query_lens[r], lens[r]
        if q_len <= 1:
            continue
        num_blocks = -(-seq_len // block_size)
        key, value = _gather_kv(kv_cache, block_table[r : r + 1], num_blocks)
        # [1, num_kv_heads, seq_len, head_size]
        key, value = key[:, :, :seq_len], value[:, :, :seq_len]
        # [q_len, num_heads, head_size] -> [1, num_heads, q_len, head_size]
        query = q[qsl[r] : qsl[r + 1]].transpose(0, 1).unsqueeze(0)
        if q_len == seq_len:
            # A whole prompt: plain causal, no context before it.
            o = F.scaled_dot_product_attention(
                query, key, value, is_causal=True, scale=softmax_scale, enable_gqa=True
            )
        else:
            # A later chunk: query i sees keys up to context + i (bottom-right aligned).
            context = seq_len - q_len
            mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=q.device).tril(context)
            o = F.scaled_dot_product_attention(
                query, key, value, attn_mask=mask, scale=softmax_scale, enable_gqa=True
            )
        # [1, num_heads, q_len, head_size] -> [q_len, num_heads, head_size]
        out[qsl[r] : qsl[r + 1]] = o.squeeze(0).transpose(0, 1)


# --8<-- [end:unified_attention_torch]
