"""The CPU backend: a C++ kernel that reads the pages in place.

Mirrors vllm/v1/attention/backends/cpu_attn.py (``CPUAttentionBackend``,
``CPU_ATTN``), vLLM's default on CPU: its ``forward`` writes the step's keys
and values into the cache and sends the queries to
``ops.cpu_attention_with_kv_cache``, a compiled kernel (on x86, Arm, s390x,
RISC-V and PowerPC all of them, prompts included; elsewhere the prompts go
to SDPA). Here the kernel
(kernels/csrc/cpu_attn.cpp) takes the decodes (single-token queries), the
bulk of a serving step, and each longer query (a prompt, a chunk of one, a
speculative verify) that attends at most ``SMALL_QUERY_LIMIT`` (query token,
key) pairs; the longer ones go one at a time to the plain-PyTorch
reference, which runs each through SDPA. A layer the kernel does not cover
(not fp32, a sliding window, a soft cap) or a run with lab 04's paged read
plugged in takes the reference backend's ``forward`` whole.

What the kernel saves (benchmarks/bench_cpu_attn.py, a 2-core AMD EPYC): the
reference gathers each decode's pages into one padded tensor, then runs SDPA
with a mask over the padding; the kernel reads each key once, where it lies.
One decode step's attention over 30 layers at batch 64: 111 ms for the
reference against 30 ms on one thread; make bench's workload through the
engine, 1.19 times the reference backend's tokens per second on one thread
and 1.30 times on two. Its prefill step (64 prompts of 24 new tokens over
40), one SDPA call per request against the kernel: 274 ms against 37 on two
threads, most of SDPA's the fixed cost of 1920 small calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

import torch

from tracevllm import _custom_ops as ops
from tracevllm.attention.backends.abstract import AttentionBackend, AttentionImpl, AttentionMetadata
from tracevllm.attention.backends.torch_attn import TorchAttentionImpl
from tracevllm.labs import selected_labs

if TYPE_CHECKING:
    from tracevllm.model_executor.layers.attention import Attention

T = TypeVar("T", int, torch.Tensor)


# A query of more than one token goes through the kernel when the (query
# token, key) pairs it attends (causal_pairs) are at most this many, through
# SDPA otherwise. The kernel's time follows the pairs (about 1.5 ms per
# thousand over 30 layers, one thread); SDPA's follows the query's tokens
# times its keys, the masked half of a fresh prompt included (about 1 ms per
# thousand, after a fixed cost of about 0.1 ms a call): a fresh prompt, half
# its square in pairs, goes faster through the kernel, a chunk over a long
# cache through SDPA. benchmarks/bench_cpu_attn.py's prefill rows
# (benchmarks/results/cpu_attn.json), kernel against SDPA, one thread and
# two: a 128-token prompt (8256 pairs) 1.61x and 1.57x; 64 tokens over 256
# (14368) 0.92x and 1.14x; 16 over 1024 (16264) 0.98x and 0.95x; past the
# limit, 64 over 1024 (63520) 0.75x and 0.86x and a 512-token prompt
# (131328) 1.20x and 0.86x.
SMALL_QUERY_LIMIT = 16384


def causal_pairs(q_len: T, seq_len: T) -> T:
    """The (query token, key) pairs a query of ``q_len`` tokens attends when its
    last token is at position ``seq_len - 1``: each token sees the keys up to
    its own. Ints or int64 tensors."""
    return q_len * (seq_len - q_len) + q_len * (q_len + 1) // 2


def _may_take_long_prefills(attn_metadata: AttentionMetadata) -> bool:
    """From the step's two maxima, without reading a tensor: False when no
    request's query can be too long for the kernel (most steps). The pairs
    grow with each of the two (a query is never longer than its seq_len)."""
    q = attn_metadata.max_query_len
    # max(q, ...): metadata whose longest query outran its longest seq_len
    # would otherwise bound too low and leave a long query to no one.
    return q > 1 and causal_pairs(q, max(q, attn_metadata.max_seq_len)) > SMALL_QUERY_LIMIT


def takes_long_prefills(attn_metadata: AttentionMetadata) -> bool:
    """Whether some request's query is too long for the kernel (SDPA's, one by one)."""
    if not _may_take_long_prefills(attn_metadata):
        return False
    qsl, seq_lens = _query_start_loc_and_seq_lens(attn_metadata)
    q_lens = (qsl[1:] - qsl[:-1]).long()
    return bool(((q_lens > 1) & (causal_pairs(q_lens, seq_lens.long()) > SMALL_QUERY_LIMIT)).any())


def _query_start_loc_and_seq_lens(
    attn_metadata: AttentionMetadata,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU copies where the runner made them (the same tensors on CPU)."""
    qsl = attn_metadata.query_start_loc_cpu
    seq_lens = attn_metadata.seq_lens_cpu
    return (
        qsl if qsl is not None else attn_metadata.query_start_loc,
        seq_lens if seq_lens is not None else attn_metadata.seq_lens,
    )


class CPUAttentionImpl(TorchAttentionImpl):
    # The cache's dtype is known at the first forward; until then, assume fp32.
    _fp32_cache = True

    def _kernel_covers(self, kv_cache: torch.Tensor) -> bool:
        self._fp32_cache = kv_cache.dtype == torch.float32
        return (
            self._fp32_cache
            and self.sliding_window[0] < 0
            and not self.logits_soft_cap
            and "unified_attention_torch" not in selected_labs()
        )

    def launch_name(self, attn_metadata: AttentionMetadata) -> str:
        if (
            self.sliding_window[0] >= 0
            or self.logits_soft_cap
            or not self._fp32_cache
            or "unified_attention_torch" in selected_labs()
        ):
            return super().launch_name(attn_metadata)
        if takes_long_prefills(attn_metadata):
            return "cpu_attention_with_kv_cache (pages read in place) + SDPA per long prefill"
        return "cpu_attention_with_kv_cache (pages read in place)"

    def do_kv_cache_update(
        self,
        layer: Attention,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_size]
        slot_mapping: torch.Tensor,  # [num_tokens], int64
    ) -> None:
        """The step's keys and values copied into their slots by the C++ kernel
        (vLLM's CPU backend has its own write too, cpu_attn_reshape_and_cache)."""
        if (
            kv_cache.dtype == key.dtype == value.dtype == torch.float32
            and slot_mapping.dtype == torch.int64
        ):
            ops.reshape_and_cache_flash(key, value, kv_cache, slot_mapping, backend="cpu")
        else:
            super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)

    # --8<-- [start:cpu_attn_forward]
    def forward(
        self,
        layer: Attention,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_size]
        attn_metadata: AttentionMetadata,
        output: torch.Tensor,  # [num_tokens, num_heads, head_size]
    ) -> torch.Tensor:
        if not self._kernel_covers(kv_cache):
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output)
        n = attn_metadata.num_actual_tokens
        qsl, seq_lens = _query_start_loc_and_seq_lens(attn_metadata)
        block_table = attn_metadata.block_table
        # Every decode and small prefill, its pages read where they lie.
        ops.cpu_attention_with_kv_cache(
            query[:n], kv_cache, output[:n], qsl, seq_lens, self.scale, block_table,
            SMALL_QUERY_LIMIT,
        )  # fmt: skip
        if _may_take_long_prefills(attn_metadata):
            # The rest, one request at a time, through the reference (SDPA).
            starts, lens = qsl.tolist(), seq_lens.tolist()
            for r, seq_len in enumerate(lens):
                start, end = starts[r], starts[r + 1]
                if end - start <= 1 or causal_pairs(end - start, seq_len) <= SMALL_QUERY_LIMIT:
                    continue
                ops.unified_attention(
                    q=query[start:end],
                    kv_cache=kv_cache,
                    out=output[start:end],
                    query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
                    seq_lens=seq_lens[r : r + 1],
                    max_query_len=end - start,
                    max_seq_len=seq_len,
                    block_table=block_table[r : r + 1],
                    softmax_scale=self.scale,
                )
        return output

    # --8<-- [end:cpu_attn_forward]


class CPUAttentionBackend(AttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return CPUAttentionImpl
