"""The readable reference backend: paged attention in plain PyTorch.

Plays the part of vllm/v1/attention/backends/triton_attn.py
(``TritonAttentionBackend``, ``TritonAttentionImpl``) with the kernels of
kernels/*.py's ``*_torch`` references, reached through ``_custom_ops``. It is
the CPU default where the C++ kernel of cpu_attn.py cannot be built, and
what that backend hands its prefills. Same KV cache layout as the Triton backend, so the two
are interchangeable. With vLLM's sliding window (``window_size``) and logit
soft cap. Left out: fp8 KV caches, ALiBi, sinks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tracevllm import _custom_ops as ops
from tracevllm.attention.backends.abstract import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
)

if TYPE_CHECKING:
    from tracevllm.model_executor.layers.attention import Attention


class TorchAttentionImpl(AttentionImpl):
    def launch_name(self, attn_metadata: AttentionMetadata) -> str:
        if self.logits_soft_cap:
            # SDPA cannot bend the scores: they are spelled out.
            return "unified_attention_torch (soft-capped scores, decodes in one padded batch)"
        return "unified_attention_torch (SDPA: one padded call for the decodes, one per prefill)"

    def do_kv_cache_update(
        self,
        layer: Attention,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_size]
        slot_mapping: torch.Tensor,  # [num_tokens]
    ) -> None:
        ops.reshape_and_cache_flash(key, value, kv_cache, slot_mapping)

    # --8<-- [start:torch_attn_forward]
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
        # key/value are already in the cache (do_kv_cache_update ran first);
        # the read goes through the block table only, as on the GPU.
        n = attn_metadata.num_actual_tokens
        qsl = attn_metadata.query_start_loc_cpu
        seq_lens = attn_metadata.seq_lens_cpu
        ops.unified_attention(
            q=query[:n],
            kv_cache=kv_cache,
            out=output[:n],
            query_start_loc=qsl if qsl is not None else attn_metadata.query_start_loc,
            seq_lens=seq_lens if seq_lens is not None else attn_metadata.seq_lens,
            max_query_len=attn_metadata.max_query_len,
            max_seq_len=attn_metadata.max_seq_len,
            block_table=attn_metadata.block_table,
            softmax_scale=self.scale,
            window_size=self.sliding_window,
            softcap=self.logits_soft_cap,
        )
        return output

    # --8<-- [end:torch_attn_forward]


class TorchAttentionBackend(AttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "TORCH_ATTN"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TorchAttentionImpl
