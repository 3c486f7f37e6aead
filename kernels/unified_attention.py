"""Paged attention over a mixed batch of prefill chunks and decodes.

Mirrors vllm/v1/attention/ops/triton_unified_attention.py (``unified_attention``,
``kernel_unified_attention``): one call serves every request of the step,
whatever its query length, reading K/V through the block table. First a
plain-PyTorch reference, then the Triton kernel and its launcher, tested
against it. Both take vLLM's sliding window (``window_size = (W - 1, 0)``:
each query sees its last W keys, itself included) and logit soft-capping
(``softcap``, Gemma-2). Left out: ALiBi, attention sinks, chunked local
attention, fp8 descales and tensor descriptors.

The same kernel has two launches, as in vLLM. The 2D grid (query block, KV
head) serves any batch. A decode-only batch of few requests would give that
grid too few programs to fill the GPU, each walking a long context alone; the
3D grid adds a third axis that cuts each context into
``NUM_PAR_SOFTMAX_SEGMENTS`` segments, each program runs the online softmax
over its segment only and stores the unnormalized partial result with its max
and sum, and ``reduce_segments`` merges the partials into the softmax over the
whole context (split-softmax, "flash decoding").

The Triton kernel walks the block table inside the kernel, one tile of keys at
a time, with an online softmax. The reference spells the same data flow with
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

from kernels.triton_utils import tl, triton


def _gather_kv(
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_size]
    block_table: torch.Tensor,  # [num_reqs, num_blocks_per_req], int32
    num_blocks: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read the first ``num_blocks`` pages of each row into contiguous K and V."""
    _, _, block_size, num_kv_heads, head_size = kv_cache.shape
    num_reqs = block_table.shape[0]
    blocks = block_table[:, :num_blocks].flatten().long()  # [num_reqs * num_blocks]
    # Each page's K (and V) is one contiguous run of block_size * num_kv_heads *
    # head_size numbers: index_select copies whole runs, a row per page.
    # [num_blocks, 2, page_numel]: a view of the engine's (contiguous) cache;
    # a non-contiguous cache (a test's slice) is copied first.
    pages = kv_cache.reshape(kv_cache.shape[0], 2, -1)
    shape = (num_reqs, num_blocks * block_size, num_kv_heads, head_size)
    key = pages[:, 0].index_select(0, blocks).view(shape)
    value = pages[:, 1].index_select(0, blocks).view(shape)
    # -> [num_reqs, num_kv_heads, num_blocks * block_size, head_size]
    return key.transpose(1, 2), value.transpose(1, 2)


def _attend(
    query: torch.Tensor,  # [batch, num_heads, q_len, head_size]
    key: torch.Tensor,  # [batch, num_kv_heads, kv_len, head_size]
    value: torch.Tensor,  # [batch, num_kv_heads, kv_len, head_size]
    allowed: torch.Tensor | None,  # bool, broadcast to [batch, num_heads, q_len, kv_len]
    scale: float,
    softcap: float,
) -> torch.Tensor:  # [batch, num_heads, q_len, head_size]
    """softmax(cap(scale * q k^T), masked) v; plain causal when ``allowed`` is None.

    Without a soft cap this is one SDPA call. Gemma-2's soft cap,
    ``softcap * tanh(s / softcap)``, bends the scores before the softmax, which
    SDPA cannot do: the scores are then spelled out, in fp32.
    """
    if softcap <= 0:
        return F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=allowed,
            is_causal=allowed is None,
            scale=scale,
            enable_gqa=True,
        )
    batch, num_heads, q_len, head_size = query.shape
    num_kv_heads, kv_len = key.shape[1], key.shape[2]
    if allowed is None:
        allowed = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril()
    # GQA: the query heads that share a KV head side by side.
    # [batch, num_kv_heads, num_heads // num_kv_heads, q_len, head_size]
    grouped = query.float().view(batch, num_kv_heads, -1, q_len, head_size)
    scores = grouped @ key.float().unsqueeze(2).transpose(-1, -2) * scale
    scores = softcap * torch.tanh(scores / softcap)
    # [batch, num_heads, q_len, kv_len], -inf where a key is not allowed
    scores = scores.view(batch, num_heads, q_len, kv_len).masked_fill(~allowed, float("-inf"))
    probs = scores.softmax(-1).view(batch, num_kv_heads, -1, q_len, kv_len)
    out = probs @ value.float().unsqueeze(2)  # [batch, num_kv_heads, group, q_len, head_size]
    return out.view(batch, num_heads, q_len, head_size).to(query.dtype)


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
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
) -> None:
    """Causal attention of each request's queries over its paged keys and values.

    Query token i of a request with ``seq_len`` L and query length Q sits at
    position p = L - Q + i and sees keys 0 .. p. With a sliding window of W
    tokens, vLLM's ``window_size = (W - 1, 0)``, it sees keys p - W + 1 .. p
    only: W keys, itself included (HF's ``kv_idx > q_idx - sliding_window``).
    ``softcap`` > 0 bends each score s into ``softcap * tanh(s / softcap)``
    before the softmax (Gemma-2). GQA: query head h reads KV head
    h // (num_heads // num_kv_heads). ``max_query_len`` and ``max_seq_len``
    size the GPU kernel's grid; the loops here find their own bounds.
    """
    block_size = kv_cache.shape[2]
    window = window_size[0] + 1 if window_size[0] >= 0 else None
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    num_reqs = len(lens)
    query_lens = [qsl[r + 1] - qsl[r] for r in range(num_reqs)]

    decodes = [r for r in range(num_reqs) if query_lens[r] == 1]
    if decodes:
        # One padded gather and one SDPA call for every single-token query.
        num_decodes, num_heads, head_size = len(decodes), q.shape[1], q.shape[2]
        num_kv_heads = kv_cache.shape[3]
        tok: torch.Tensor | slice  # each decode's token
        if num_decodes == num_reqs:
            # A decode-only step (the common one): token r is request r's.
            tok, decode_tables, decode_lens = slice(0, num_reqs), block_table, seq_lens
        else:
            idx = torch.tensor(decodes, dtype=torch.long, device=q.device)  # [num_decodes]
            tok = query_start_loc.to(torch.long)[idx]  # [num_decodes]
            decode_tables, decode_lens = block_table[idx], seq_lens[idx]
        decode_lens = decode_lens.to(torch.long)
        if window is None:
            num_blocks = -(-max(lens[r] for r in decodes) // block_size)
            key_start = torch.zeros_like(decode_lens)  # [num_decodes]
        else:
            # Only the pages of each decode's last W keys (those before were
            # freed: SlidingWindowManager), from the page holding key L - W on.
            first = (decode_lens - window).clamp(min=0) // block_size  # [num_decodes]
            # At most cdiv(W, block_size) + 1 pages hold W keys; never more than the longest needs.
            num_blocks = min(
                -(-window // block_size) + 1, -(-max(lens[r] for r in decodes) // block_size)
            )
            cols = first[:, None] + torch.arange(num_blocks, device=q.device)
            # A column past the table holds keys past seq_len: masked below.
            cols = cols.clamp(max=decode_tables.shape[1] - 1)
            decode_tables = decode_tables.gather(1, cols)  # [num_decodes, num_blocks]
            key_start = first * block_size
        key, value = _gather_kv(kv_cache, decode_tables, num_blocks)
        # GQA without copying K/V: the query heads that share a KV head become
        # that head's query rows. [num_decodes, num_heads, head_size] ->
        # [num_decodes, num_kv_heads, num_heads // num_kv_heads, head_size]
        query = q[tok].view(num_decodes, num_kv_heads, -1, head_size)
        key_pos = key_start[:, None] + torch.arange(num_blocks * block_size, device=q.device)
        allowed = key_pos < decode_lens[:, None]  # [num_decodes, max_kv_len]: not padding
        if window is not None:
            allowed &= key_pos >= (decode_lens - window)[:, None]
        o = _attend(query, key, value, allowed[:, None, None, :], softmax_scale, softcap)
        out[tok] = o.reshape(num_decodes, num_heads, head_size)

    for r in range(num_reqs):
        q_len, seq_len = query_lens[r], lens[r]
        if q_len <= 1:
            continue
        context = seq_len - q_len  # tokens cached before this chunk
        # The first page any of the chunk's queries sees (0 without a window).
        first_page = max(context - window + 1, 0) // block_size if window else 0
        num_blocks = -(-seq_len // block_size) - first_page
        key, value = _gather_kv(kv_cache, block_table[r : r + 1, first_page:], num_blocks)
        start = first_page * block_size  # the position of the first key gathered
        # [1, num_kv_heads, seq_len - start, head_size]
        key, value = key[:, :, : seq_len - start], value[:, :, : seq_len - start]
        # [q_len, num_heads, head_size] -> [1, num_heads, q_len, head_size]
        query = q[qsl[r] : qsl[r + 1]].transpose(0, 1).unsqueeze(0)
        mask: torch.Tensor | None = None  # a whole prompt without a window: plain causal
        if q_len != seq_len or window is not None:
            # Query i sits at context + i and sees keys up to it (bottom-right
            # aligned), and with a window none W or more positions behind it.
            q_pos = torch.arange(context, seq_len, device=q.device)[:, None]  # [q_len, 1]
            k_pos = torch.arange(start, seq_len, device=q.device)[None, :]  # [1, kv_len]
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
        o = _attend(query, key, value, mask, softmax_scale, softcap)
        # [1, num_heads, q_len, head_size] -> [q_len, num_heads, head_size]
        out[qsl[r] : qsl[r + 1]] = o.squeeze(0).transpose(0, 1)


# --8<-- [end:unified_attention_torch]


@triton.jit
def find_seq_idx(
    query_start_len_ptr,  # [num_seqs + 1]
    target_idx,  # a query block (use_q_block_mode) or a query token
    num_seqs,
    BLOCK_Q: tl.constexpr,
    use_q_block_mode: tl.constexpr,
):
    """The request that owns ``target_idx``: binary search over the starts.

    Query-block mode: request r's blocks start at ``qsl[r] // BLOCK_Q + r``
    (the launcher's upper bound on the block count, see there), which grows
    with r. Token mode: request r's tokens start at ``qsl[r]``. Either way,
    the answer is the last request whose start is <= ``target_idx``.
    """
    left: tl.int32 = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        mid_start = tl.load(query_start_len_ptr + mid)
        if use_q_block_mode:
            mid_start = mid_start // BLOCK_Q + mid
        if mid_start <= target_idx:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def apply_softcap(S, x):
    """``x * tanh(S / x)``, from ``tanh(y) = 1 - 2 / (exp(2y) + 1)``.

    vLLM's helper writes ``(e^y - e^-y) / (e^y + e^-y)``, which is inf / inf =
    NaN once e^y overflows (y > 88 in fp32); this form saturates at +-1.
    """
    return x * (1.0 - 2.0 / (tl.exp(2.0 * S / x) + 1.0))


# --8<-- [start:kernel_unified_attention]
@triton.jit
def kernel_unified_attention(
    output_ptr,  # [num_tokens, num_query_heads, head_size]
    segm_output_ptr,  # 3D: [num_tokens, num_query_heads, NUM_SEGMENTS_PER_SEQ, HEAD_SIZE_PADDED]
    segm_max_ptr,  # 3D: [num_tokens, num_query_heads, NUM_SEGMENTS_PER_SEQ]
    segm_expsum_ptr,  # 3D: [num_tokens, num_query_heads, NUM_SEGMENTS_PER_SEQ]
    query_ptr,  # [num_tokens, num_query_heads, head_size]
    key_cache_ptr,  # kv_cache[:, 0]: [num_blocks, block_size, num_kv_heads, head_size]
    value_cache_ptr,  # kv_cache[:, 1]: [num_blocks, block_size, num_kv_heads, head_size]
    block_tables_ptr,  # [num_seqs, max_num_blocks_per_seq]
    seq_lens_ptr,  # [num_seqs]
    query_start_len_ptr,  # [num_seqs + 1]
    scale,  # float: softmax_scale
    softcap,  # float: logits soft cap (read when USE_SOFTCAP)
    num_seqs,  # int
    block_table_stride,
    query_stride_0,
    query_stride_1,
    output_stride_0,
    output_stride_1,
    stride_cache_0,  # one page
    stride_cache_1,  # one slot inside a page
    stride_cache_2,  # one KV head
    stride_cache_3,  # one element of head_size
    num_query_heads: tl.constexpr,
    num_queries_per_kv: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV cache page
    TILE_SIZE: tl.constexpr,  # keys per loop iteration, a power of two >= 16
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,  # a power of two >= 16 (tl.arange and tl.dot need it)
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # rows per program: BLOCK_Q * num_queries_per_kv, padded
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 (no TF32 rounding), else None: the default
    NUM_SEGMENTS_PER_SEQ: tl.constexpr,  # 3D: segments per context; 2D: 1
    IS_3D: tl.constexpr,  # the split-softmax launch: grid axis 2 is the segment
    USE_SOFTCAP: tl.constexpr,  # scores become softcap * tanh(score / softcap)
    SLIDING_WINDOW: tl.constexpr,  # W: a query sees its last W keys; 0: every earlier key
):
    """Causal attention of one (query block, KV head) pair over its request's paged keys.

    Grid: ``(total_num_q_blocks, num_kv_heads)``. The batch's query tokens are
    cut, request by request, into blocks of ``BLOCK_Q`` tokens; a request of
    query length Q owns ``cdiv(Q, BLOCK_Q)`` blocks, so a decode owns one and a
    prefill chunk several. Program ``(b, h)`` takes query block b and KV head h.

    Tiling. The program's ``BLOCK_M`` rows are its ``BLOCK_Q`` tokens times the
    ``num_queries_per_kv`` query heads that share KV head h (GQA): row m is
    token ``m // num_queries_per_kv``, head ``h * num_queries_per_kv + m %
    num_queries_per_kv``. All rows read the same keys, so each K/V tile is
    loaded once for all of them. The keys are walked ``TILE_SIZE`` at a time;
    each key's page comes from the block table, so a tile may span pages. An
    online softmax (running max M, running sum L, rescaled accumulator) folds
    each tile in, and the [BLOCK_M, seq_len] score matrix never exists.

    Causality with a query offset: the request's ``context_len = seq_len -
    query_len`` tokens were cached before this step, so query token i sits at
    position ``context_len + i`` and sees keys ``0 .. context_len + i``.

    Sliding window (``SLIDING_WINDOW`` = W > 0): query position p also needs
    ``p - key < W``. The block's first row sees the earliest key, so the walk
    starts at the tile holding key ``context_len + first_row - W + 1``: the
    tiles before it (pages the KV manager may have freed) are never read.

    3D (``IS_3D``, grid ``(total_num_q_blocks, num_kv_heads,
    NUM_SEGMENTS_PER_SEQ)``): program ``(b, h, s)`` walks only the tiles of
    segment s and stores ``acc`` unnormalized, with M and L, for
    ``reduce_segments``.
    """
    q_block_global_idx = tl.program_id(0)
    kv_head_idx = tl.program_id(1)
    segm_idx = tl.program_id(2) if IS_3D else 0

    seq_idx = find_seq_idx(query_start_len_ptr, q_block_global_idx, num_seqs, BLOCK_Q, True)
    q_start = tl.load(query_start_len_ptr + seq_idx)  # first token of the request
    query_len = tl.load(query_start_len_ptr + seq_idx + 1) - q_start
    q_block_local_idx = q_block_global_idx - (q_start // BLOCK_Q + seq_idx)
    if q_block_local_idx * BLOCK_Q >= query_len:
        return  # a spare block of the upper bound: no tokens here
    seq_len = tl.load(seq_lens_ptr + seq_idx)
    context_len = seq_len - query_len
    if IS_3D:
        # Each segment takes an equal run of whole tiles; a short context
        # leaves the last segments without any, and their programs idle.
        tiles_per_segment = tl.cdiv(seq_len, NUM_SEGMENTS_PER_SEQ * TILE_SIZE)
        if segm_idx * tiles_per_segment * TILE_SIZE >= seq_len:
            return

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_SIZE_PADDED)
    offs_t = tl.arange(0, TILE_SIZE)
    query_pos = q_block_local_idx * BLOCK_Q + offs_m // num_queries_per_kv  # [BLOCK_M]
    query_head = kv_head_idx * num_queries_per_kv + offs_m % num_queries_per_kv  # [BLOCK_M]
    # Rows past BLOCK_Q * num_queries_per_kv pad BLOCK_M to a power of two.
    row_mask = (offs_m < BLOCK_Q * num_queries_per_kv) & (query_pos < query_len)
    dim_mask = offs_d < HEAD_SIZE

    q_offset = (q_start + query_pos)[:, None] * query_stride_0
    q_offset += query_head[:, None] * query_stride_1 + offs_d[None, :]
    # Q: [BLOCK_M, HEAD_SIZE_PADDED], loaded once, reused for every tile
    Q = tl.load(query_ptr + q_offset, mask=row_mask[:, None] & dim_mask[None, :], other=0.0)

    M = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running row max
    L = tl.zeros([BLOCK_M], dtype=tl.float32)  # running row sum of exp(S - M)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE_PADDED], dtype=tl.float32)  # running P @ V

    # The last row of this block sees the most keys; no tile past them is read.
    last_query_pos = tl.minimum(query_len, (q_block_local_idx + 1) * BLOCK_Q) - 1
    max_seq_prefix_len = context_len + last_query_pos + 1
    num_tiles = tl.cdiv(max_seq_prefix_len, TILE_SIZE)
    tile_lo = 0
    if SLIDING_WINDOW > 0:
        first_key = context_len + q_block_local_idx * BLOCK_Q - SLIDING_WINDOW + 1
        tile_lo = tl.maximum(first_key, 0) // TILE_SIZE
    if IS_3D:
        # A segment's tiles before the window stay unread: it stores an empty
        # partial (M = -inf, L = 0), which reduce_segments weighs by 0.
        segment_lo = segm_idx * tiles_per_segment
        num_tiles = tl.minimum(num_tiles, segment_lo + tiles_per_segment)
        tile_lo = tl.maximum(tile_lo, segment_lo)
    block_table_row = block_tables_ptr + seq_idx.to(tl.int64) * block_table_stride

    for j in range(tile_lo, num_tiles):
        seq_offset = j * TILE_SIZE + offs_t  # [TILE_SIZE] key positions
        tile_mask = seq_offset < max_seq_prefix_len
        # The page table walk: key position -> physical page, one lookup per key.
        physical_block_idx = tl.load(
            block_table_row + seq_offset // BLOCK_SIZE, mask=tile_mask, other=0
        ).to(tl.int64)  # [TILE_SIZE]
        kv_offset = physical_block_idx * stride_cache_0 + (seq_offset % BLOCK_SIZE) * stride_cache_1
        kv_offset += kv_head_idx * stride_cache_2
        # K: [HEAD_SIZE_PADDED, TILE_SIZE], loaded transposed for Q @ K
        K = tl.load(
            key_cache_ptr + kv_offset[None, :] + offs_d[:, None] * stride_cache_3,
            mask=dim_mask[:, None] & tile_mask[None, :],
            other=0.0,
        )
        # V: [TILE_SIZE, HEAD_SIZE_PADDED]
        V = tl.load(
            value_cache_ptr + kv_offset[:, None] + offs_d[None, :] * stride_cache_3,
            mask=tile_mask[:, None] & dim_mask[None, :],
            other=0.0,
        )

        # S: [BLOCK_M, TILE_SIZE]
        S = scale * tl.dot(Q, K, input_precision=DOT_PRECISION)
        if USE_SOFTCAP:
            S = apply_softcap(S, softcap)
        query_abs_pos = (context_len + query_pos)[:, None]  # [BLOCK_M, 1]
        seq_mask = seq_offset[None, :] <= query_abs_pos  # causal
        if SLIDING_WINDOW > 0:
            seq_mask = seq_mask & (query_abs_pos - seq_offset[None, :] < SLIDING_WINDOW)
        S = tl.where(row_mask[:, None] & tile_mask[None, :] & seq_mask, S, float("-inf"))

        # Online softmax: fold this tile into (M, L, acc).
        M_new = tl.maximum(M, tl.max(S, axis=1))  # [BLOCK_M]
        # A row with every key masked so far (a padding row) keeps M = -inf;
        # shift by 0 instead, or exp(-inf - -inf) would be NaN.
        M_new = tl.where(M_new > float("-inf"), M_new, 0.0)
        P = tl.exp(S - M_new[:, None])  # [BLOCK_M, TILE_SIZE]
        alpha = tl.exp(M - M_new)  # [BLOCK_M]: rescales what was summed under the old max
        L = L * alpha + tl.sum(P, axis=1)
        if SLIDING_WINDOW > 0:
            # Keys before every row's window may sit in pages the KV manager
            # freed and handed on: their P is 0, but 0 * NaN is not (vLLM's guard).
            first_row_pos = context_len + q_block_local_idx * BLOCK_Q
            V = tl.where((first_row_pos - seq_offset < SLIDING_WINDOW)[:, None], V, 0.0)
        acc = acc * alpha[:, None] + tl.dot(P.to(V.dtype), V, input_precision=DOT_PRECISION)
        M = M_new

    if IS_3D:
        # This segment's partial softmax: unnormalized acc, its max M and sum L.
        segm_row = (q_start + query_pos).to(tl.int64) * num_query_heads + query_head
        segm_row = segm_row * NUM_SEGMENTS_PER_SEQ + segm_idx  # [BLOCK_M]
        segm_offset = segm_row[:, None] * HEAD_SIZE_PADDED + offs_d[None, :]
        tl.store(segm_output_ptr + segm_offset, acc, mask=row_mask[:, None])
        tl.store(segm_max_ptr + segm_row, M, mask=row_mask)
        tl.store(segm_expsum_ptr + segm_row, L, mask=row_mask)
    else:
        # Padding rows have L = 0 and are not stored; divide them by 1, not 0.
        acc = acc / tl.where(L > 0.0, L, 1.0)[:, None]
        out_offset = (q_start + query_pos)[:, None] * output_stride_0
        out_offset += query_head[:, None] * output_stride_1 + offs_d[None, :]
        tl.store(output_ptr + out_offset, acc, mask=row_mask[:, None] & dim_mask[None, :])


# --8<-- [end:kernel_unified_attention]


# --8<-- [start:reduce_segments]
@triton.jit
def reduce_segments(
    output_ptr,  # [num_tokens, num_query_heads, head_size]
    segm_output_ptr,  # [num_tokens, num_query_heads, NUM_SEGMENTS_PER_SEQ, HEAD_SIZE_PADDED]
    segm_max_ptr,  # [num_tokens, num_query_heads, NUM_SEGMENTS_PER_SEQ]
    segm_expsum_ptr,  # [num_tokens, num_query_heads, NUM_SEGMENTS_PER_SEQ]
    seq_lens_ptr,  # [num_seqs]
    query_start_len_ptr,  # [num_seqs + 1]
    num_seqs,  # int
    output_stride_0,
    output_stride_1,
    num_query_heads: tl.constexpr,
    TILE_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    NUM_SEGMENTS_PER_SEQ: tl.constexpr,
):
    """Merge one (query token, query head)'s segments into its softmax output.

    Grid: ``(num_tokens, num_query_heads)``. Segment s holds ``acc_s = sum
    exp(S - M_s) V`` and ``L_s = sum exp(S - M_s)`` over its keys. With ``M =
    max_s M_s``, the whole context's output is ``sum_s exp(M_s - M) acc_s /
    sum_s exp(M_s - M) L_s``: the online softmax's rescaling, once per segment.
    """
    query_token_idx = tl.program_id(0)
    query_head_idx = tl.program_id(1)
    seq_idx = find_seq_idx(query_start_len_ptr, query_token_idx, num_seqs, 1, False)
    seq_len = tl.load(seq_lens_ptr + seq_idx)

    # The segments that had tiles (the kernel's early return skipped the rest).
    tiles_per_segment = tl.cdiv(seq_len, NUM_SEGMENTS_PER_SEQ * TILE_SIZE)
    num_segments = tl.cdiv(seq_len, tiles_per_segment * TILE_SIZE)
    offs_s = tl.arange(0, NUM_SEGMENTS_PER_SEQ)
    offs_d = tl.arange(0, HEAD_SIZE_PADDED)
    segm_mask = offs_s < num_segments
    dim_mask = offs_d < HEAD_SIZE

    segm_row = (query_token_idx.to(tl.int64) * num_query_heads + query_head_idx) * (
        NUM_SEGMENTS_PER_SEQ
    ) + offs_s  # [NUM_SEGMENTS_PER_SEQ]
    segm_max = tl.load(segm_max_ptr + segm_row, mask=segm_mask, other=float("-inf"))
    overall_max = tl.max(segm_max, axis=0)
    rescale = tl.exp(segm_max - overall_max)  # [NUM_SEGMENTS_PER_SEQ]; 0 where masked
    segm_expsum = tl.load(segm_expsum_ptr + segm_row, mask=segm_mask, other=0.0)
    overall_expsum = tl.sum(segm_expsum * rescale, axis=0)
    segm_output = tl.load(
        segm_output_ptr + segm_row[:, None] * HEAD_SIZE_PADDED + offs_d[None, :],
        mask=segm_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )  # [NUM_SEGMENTS_PER_SEQ, HEAD_SIZE_PADDED]
    acc = tl.sum(segm_output * rescale[:, None], axis=0) / overall_expsum
    out_offset = query_token_idx * output_stride_0 + query_head_idx * output_stride_1
    tl.store(output_ptr + out_offset + offs_d, acc, mask=dim_mask)


# --8<-- [end:reduce_segments]

# vLLM's defaults (v1/attention/backends/triton_attn.py): below this many
# programs the 2D grid leaves a GPU's SMs idle, and so many segments per context.
MIN_LAUNCH_GRID_SIZE_2D = 128
NUM_PAR_SOFTMAX_SEGMENTS = 16


def use_split_softmax(max_query_len: int, num_seqs: int, seq_threshold_3D: int | None) -> bool:
    """vLLM's choice of the 3D launch: decodes only, and few enough of them."""
    return seq_threshold_3D is not None and max_query_len == 1 and num_seqs <= seq_threshold_3D


# --8<-- [start:unified_attention_triton]
def unified_attention_triton(
    q: torch.Tensor,  # [num_tokens, num_heads, head_size]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_size]
    out: torch.Tensor,  # [num_tokens, num_heads, head_size], written in place
    query_start_loc: torch.Tensor,  # [num_reqs + 1], int32
    seq_lens: torch.Tensor,  # [num_reqs], int32
    max_query_len: int,
    max_seq_len: int,
    block_table: torch.Tensor,  # [num_reqs, max_num_blocks_per_req], int32
    softmax_scale: float,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    seq_threshold_3D: int | None = None,
    num_par_softmax_segments: int = NUM_PAR_SOFTMAX_SEGMENTS,
) -> None:
    """Launch ``kernel_unified_attention`` over every request of the step at once.

    Same contract as ``unified_attention_torch``. The window and the soft cap
    are compile-time constants (``SLIDING_WINDOW``, ``USE_SOFTCAP``), as in
    vLLM: each window size is its own compiled kernel. As in vLLM, a decode-only
    batch (``max_query_len == 1``) of at most ``seq_threshold_3D`` requests
    takes the 3D split-softmax launch plus ``reduce_segments``; everything
    else, and every batch when ``seq_threshold_3D`` is None, the 2D launch.
    """
    num_seqs = seq_lens.shape[0]
    num_tokens, num_query_heads, head_size = q.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    num_queries_per_kv = num_query_heads // num_kv_heads
    head_size_padded = max(16, triton.next_power_of_2(head_size))
    key_cache, value_cache = kv_cache[:, 0], kv_cache[:, 1]
    if num_tokens == 0:
        return

    # tl.dot wants every side >= 16: at least 16 rows, filled with as many
    # whole tokens' worth of GQA heads as fit.
    block_m = max(16, triton.next_power_of_2(num_queries_per_kv))
    block_q = block_m // num_queries_per_kv
    # The exact number of query blocks, sum_r cdiv(query_len_r, BLOCK_Q), needs
    # the query lengths on the host (a device sync). vLLM launches an upper
    # bound instead, floor(num_tokens / BLOCK_Q) + num_seqs; spare programs return.
    total_num_q_blocks = num_tokens // block_q + num_seqs

    use_3d = use_split_softmax(max_query_len, num_seqs, seq_threshold_3D)
    if use_3d:
        # Per-segment partials, in fp32. vLLM allocates these once, in the
        # metadata builder, so CUDA graphs see fixed addresses; here each call
        # takes them from torch's caching allocator.
        segments = num_par_softmax_segments
        segm_output = q.new_empty(
            (num_tokens, num_query_heads, segments, head_size_padded), dtype=torch.float32
        )
        segm_max = q.new_empty((num_tokens, num_query_heads, segments), dtype=torch.float32)
        segm_expsum = torch.empty_like(segm_max)
        grid: tuple[int, ...] = (total_num_q_blocks, num_kv_heads, segments)
        tile_size = 16  # vLLM's decode tile (for 16- and 32-bit K/V)
    else:
        # Never touched by the 2D launch, but every pointer argument needs a tensor.
        segm_output = segm_max = segm_expsum = out
        segments = 1
        grid = (total_num_q_blocks, num_kv_heads)
        tile_size = 32  # vLLM's prefill tile

    kernel_unified_attention[grid](
        out,
        segm_output,
        segm_max,
        segm_expsum,
        q,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        query_start_loc,
        softmax_scale,
        softcap,
        num_seqs,
        block_table.stride(0),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        key_cache.stride(3),
        num_query_heads=num_query_heads,
        num_queries_per_kv=num_queries_per_kv,
        BLOCK_SIZE=block_size,
        TILE_SIZE=tile_size,
        HEAD_SIZE=head_size,
        HEAD_SIZE_PADDED=head_size_padded,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
        NUM_SEGMENTS_PER_SEQ=segments,
        IS_3D=use_3d,
        USE_SOFTCAP=softcap > 0,
        SLIDING_WINDOW=1 + window_size[0],  # vLLM's: (-1, -1) -> 0, no window
    )
    if use_3d:
        reduce_segments[(num_tokens, num_query_heads)](
            out,
            segm_output,
            segm_max,
            segm_expsum,
            seq_lens,
            query_start_loc,
            num_seqs,
            out.stride(0),
            out.stride(1),
            num_query_heads=num_query_heads,
            TILE_SIZE=tile_size,
            HEAD_SIZE=head_size,
            HEAD_SIZE_PADDED=head_size_padded,
            NUM_SEGMENTS_PER_SEQ=segments,
        )


# --8<-- [end:unified_attention_triton]
