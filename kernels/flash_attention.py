"""FlashAttention's forward pass, from PyTorch to Triton, in three steps.

Mirrors vllm/v1/attention/ops/triton_prefill_attention.py
(``context_attention_fwd``, adapted from SGLang and LightLLM, which vLLM's
Triton backend uses for encoder attention): one program per (query block,
head), a loop over key blocks with an online softmax, 32-wide tiles for fp32.
triton_unified_attention.py is the same loop plus a page table, and
vllm_flash_attn is Tri Dao's CUDA version. The three steps compute the same
function:

1. ``naive_attention``: softmax(Q K^T * scale) V, the whole score matrix at once.
2. ``blocked_attention``: the same, one block of keys at a time, with an online
   softmax (running max, running sum, rescaled accumulator), so the
   [q_len, kv_len] score matrix never exists. This is the algorithm.
3. ``flash_attention_triton``: step 2 as a Triton kernel, one program per
   (query block, batch * head).

Left out: the backward pass, dropout, attention masks other than causal, the
exp2 and deferred-rescaling tricks of FlashAttention-2/3, and autotuning.
"""

from __future__ import annotations

import torch

from kernels.triton_utils import tl, triton


# --8<-- [start:naive_attention]
def naive_attention(
    q: torch.Tensor,  # [batch, num_heads, q_len, head_size]
    k: torch.Tensor,  # [batch, num_kv_heads, kv_len, head_size]
    v: torch.Tensor,  # [batch, num_kv_heads, kv_len, head_size]
    causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:  # [batch, num_heads, q_len, head_size]
    """Attention as written on the blackboard: every score, then the softmax.

    Causal is bottom-right aligned: with ``kv_len > q_len`` the queries are the
    last ``q_len`` positions (a prefill chunk after cached context), so query i
    sees keys ``0 .. kv_len - q_len + i``. GQA: query head h reads KV head
    ``h // (num_heads // num_kv_heads)``.
    """
    q_len, kv_len = q.shape[2], k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # [batch, num_heads, kv_len, head_size]
    v = v.repeat_interleave(group, dim=1)  # [batch, num_heads, kv_len, head_size]
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale  # [batch, heads, q_len, kv_len]
    if causal:
        q_pos = torch.arange(q_len, device=q.device)[:, None] + (kv_len - q_len)
        allowed = torch.arange(kv_len, device=q.device)[None, :] <= q_pos  # [q_len, kv_len]
        scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(dim=-1) @ v.float()).to(q.dtype)


# --8<-- [end:naive_attention]


# --8<-- [start:blocked_attention]
def blocked_attention(
    q: torch.Tensor,  # [batch, num_heads, q_len, head_size]
    k: torch.Tensor,  # [batch, num_kv_heads, kv_len, head_size]
    v: torch.Tensor,  # [batch, num_kv_heads, kv_len, head_size]
    causal: bool = True,
    scale: float | None = None,
    block_m: int = 64,
    block_n: int = 64,
) -> torch.Tensor:  # [batch, num_heads, q_len, head_size]
    """``naive_attention`` one [block_m, block_n] tile of scores at a time.

    The outer loop is what the Triton grid runs in parallel (one program per
    query block); the inner loop is what each program runs in order. For each
    query row it keeps three running values over the keys seen so far:

    - ``m_i``: the largest score (subtracted before ``exp``, so nothing overflows),
    - ``l_i``: the sum of ``exp(score - m_i)``,
    - ``acc``: the sum of ``exp(score - m_i) * value``.

    When a new key block raises the max from ``m_i`` to ``m_new``, everything
    summed so far was scaled by ``exp(-m_i)`` and must be by ``exp(-m_new)``:
    multiply ``l_i`` and ``acc`` by ``alpha = exp(m_i - m_new)``. After the last
    block, ``acc / l_i`` is exactly the softmax-weighted sum of the values.
    """
    batch, num_heads, q_len, head_size = q.shape
    kv_len = k.shape[2]
    scale = head_size**-0.5 if scale is None else scale
    group = num_heads // k.shape[1]
    k = k.repeat_interleave(group, dim=1).float()  # [batch, num_heads, kv_len, head_size]
    v = v.repeat_interleave(group, dim=1).float()  # [batch, num_heads, kv_len, head_size]
    offset = kv_len - q_len  # causal: query i sits at position offset + i
    out = torch.empty_like(q)

    for start_m in range(0, q_len, block_m):  # the Triton grid's axis 0
        q_blk = q[:, :, start_m : start_m + block_m].float()  # [batch, heads, bm, head_size]
        q_pos = torch.arange(start_m, start_m + q_blk.shape[2], device=q.device) + offset
        m_i = torch.full(q_blk.shape[:-1], float("-inf"), device=q.device)  # [batch, heads, bm]
        l_i = torch.zeros(q_blk.shape[:-1], device=q.device)  # [batch, heads, bm]
        acc = torch.zeros_like(q_blk)  # [batch, heads, bm, head_size]
        # Causal: key blocks past the block's last query position are all masked.
        end_n = min(kv_len, int(q_pos[-1]) + 1) if causal else kv_len
        for start_n in range(0, end_n, block_n):  # each program's loop
            k_blk = k[:, :, start_n : start_n + block_n]  # [batch, heads, bn, head_size]
            v_blk = v[:, :, start_n : start_n + block_n]  # [batch, heads, bn, head_size]
            s = (q_blk @ k_blk.transpose(-1, -2)) * scale  # [batch, heads, bm, bn]
            if causal:
                k_pos = torch.arange(start_n, start_n + k_blk.shape[2], device=q.device)
                s = s.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
            m_new = torch.maximum(m_i, s.amax(dim=-1))  # [batch, heads, bm]
            p = torch.exp(s - m_new[..., None])  # [batch, heads, bm, bn]
            alpha = torch.exp(m_i - m_new)  # [batch, heads, bm]
            l_i = l_i * alpha + p.sum(dim=-1)
            acc = acc * alpha[..., None] + p @ v_blk
            m_i = m_new
        out[:, :, start_m : start_m + block_m] = (acc / l_i[..., None]).to(q.dtype)
    return out


# --8<-- [end:blocked_attention]


# --8<-- [start:flash_attention_kernel]
@triton.jit
def flash_attention_kernel(
    q_ptr,  # [batch, num_heads, q_len, head_size]
    k_ptr,  # [batch, num_kv_heads, kv_len, head_size]
    v_ptr,  # [batch, num_kv_heads, kv_len, head_size]
    out_ptr,  # [batch, num_heads, q_len, head_size]
    scale,
    q_len,
    kv_len,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_ob,
    stride_oh,
    stride_om,
    num_heads: tl.constexpr,
    num_queries_per_kv: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,  # a power of two >= 16
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # keys per loop iteration
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 (no TF32 rounding), else None: the default
):
    """``blocked_attention``'s inner loop for one query block of one head.

    Grid: ``(cdiv(q_len, BLOCK_M), batch * num_heads)``. Program ``(i, bh)``
    owns query rows ``[i * BLOCK_M, (i + 1) * BLOCK_M)`` of batch ``bh //
    num_heads``, head ``bh % num_heads``: it loads its Q tile once, then walks
    the keys ``BLOCK_N`` at a time, keeping (m_i, l_i, acc) in registers, and writes
    its output tile once. K and V are read once per query block (``q_len /
    BLOCK_M`` times) and no score ever reaches memory, where ``naive_attention``
    writes all ``q_len * kv_len`` of them and reads them back.
    """
    start_m = tl.program_id(0) * BLOCK_M
    batch_head = tl.program_id(1)
    batch = batch_head // num_heads
    head = batch_head % num_heads
    kv_head = head // num_queries_per_kv  # GQA: a group of query heads shares one KV head

    offs_m = start_m + tl.arange(0, BLOCK_M)  # [BLOCK_M] query rows
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.arange(0, HEAD_SIZE_PADDED)  # [HEAD_SIZE_PADDED]
    row_mask = offs_m < q_len
    dim_mask = offs_d < HEAD_SIZE

    q_base = q_ptr + batch.to(tl.int64) * stride_qb + head * stride_qh
    k_base = k_ptr + batch.to(tl.int64) * stride_kb + kv_head * stride_kh
    v_base = v_ptr + batch.to(tl.int64) * stride_vb + kv_head * stride_vh
    # Q: [BLOCK_M, HEAD_SIZE_PADDED]
    Q = tl.load(
        q_base + offs_m[:, None] * stride_qm + offs_d[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE_PADDED], dtype=tl.float32)

    offset = kv_len - q_len  # causal: query i sits at key position offset + i
    if CAUSAL:
        # Keys past this block's last query are masked for every row: skip them.
        end_n = tl.minimum(kv_len, offset + start_m + BLOCK_M)
    else:
        end_n = kv_len
    for start_n in range(0, end_n, BLOCK_N):
        key_pos = start_n + offs_n  # [BLOCK_N]
        key_mask = key_pos < kv_len
        # K: [HEAD_SIZE_PADDED, BLOCK_N], loaded transposed for Q @ K
        K = tl.load(
            k_base + key_pos[None, :] * stride_kn + offs_d[:, None],
            mask=dim_mask[:, None] & key_mask[None, :],
            other=0.0,
        )
        S = scale * tl.dot(Q, K, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        mask = row_mask[:, None] & key_mask[None, :]
        if CAUSAL:
            mask = mask & (key_pos[None, :] <= (offset + offs_m)[:, None])
        S = tl.where(mask, S, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(S, axis=1))  # [BLOCK_M]
        # Rows past q_len (or before any allowed key) stay at -inf: shift by 0.
        m_new = tl.where(m_new > float("-inf"), m_new, 0.0)
        P = tl.exp(S - m_new[:, None])  # [BLOCK_M, BLOCK_N]
        alpha = tl.exp(m_i - m_new)  # [BLOCK_M]
        l_i = l_i * alpha + tl.sum(P, axis=1)
        # V: [BLOCK_N, HEAD_SIZE_PADDED]
        V = tl.load(
            v_base + key_pos[:, None] * stride_vn + offs_d[None, :],
            mask=key_mask[:, None] & dim_mask[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(P.to(V.dtype), V, input_precision=DOT_PRECISION)
        m_i = m_new

    acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_base = out_ptr + batch.to(tl.int64) * stride_ob + head * stride_oh
    tl.store(
        o_base + offs_m[:, None] * stride_om + offs_d[None, :],
        acc,
        mask=row_mask[:, None] & dim_mask[None, :],
    )


# --8<-- [end:flash_attention_kernel]


# --8<-- [start:flash_attention_triton]
def flash_attention_triton(
    q: torch.Tensor,  # [batch, num_heads, q_len, head_size]
    k: torch.Tensor,  # [batch, num_kv_heads, kv_len, head_size]
    v: torch.Tensor,  # [batch, num_kv_heads, kv_len, head_size]
    causal: bool = True,
    scale: float | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:  # [batch, num_heads, q_len, head_size]
    """Launch ``flash_attention_kernel``: ``naive_attention``'s result, tile by tile.

    Tiles default to 64 x 64 for 16-bit inputs and 32 x 32 for fp32, whose
    tiles take twice the bytes: at 64 x 64 and head size 128, Triton's
    pipelined loads would need 176 KiB of shared memory per program, more than
    an A100 has (163 KiB; ``kernels/aot.py`` measures it without a GPU).
    """
    batch, num_heads, q_len, head_size = q.shape
    default_tile = 64 if q.element_size() <= 2 else 32
    block_m, block_n = block_m or default_tile, block_n or default_tile
    kv_len = k.shape[2]
    # The kernel steps along head_size with stride 1.
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.empty_like(q)
    grid = (triton.cdiv(q_len, block_m), batch * num_heads)
    flash_attention_kernel[grid](
        q,
        k,
        v,
        out,
        head_size**-0.5 if scale is None else scale,
        q_len,
        kv_len,
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *out.stride()[:3],
        num_heads=num_heads,
        num_queries_per_kv=num_heads // k.shape[1],
        HEAD_SIZE=head_size,
        HEAD_SIZE_PADDED=max(16, triton.next_power_of_2(head_size)),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        CAUSAL=causal,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
    )
    return out


# --8<-- [end:flash_attention_triton]
