"""The Triton backend: the paged write and read as Triton kernels.

Mirrors vllm/v1/attention/backends/triton_attn.py (``TritonAttentionBackend``,
``TritonAttentionImpl``): ``do_kv_cache_update`` launches
``reshape_and_cache_kernel_flash`` and ``forward`` launches
``kernel_unified_attention`` (kernels/), both through ``_custom_ops``; a
decode-only step of at most ``seq_threshold_3D`` requests takes the 3D
split-softmax launch, as vLLM's ``TritonAttentionMetadataBuilder`` sets it up
(``MIN_LAUNCH_GRID_SIZE_2D // num_kv_heads``). The
default on CUDA; on CPU it runs only in Triton's interpreter
(``TRITON_INTERPRET=1``), slowly, which is how the tests check it against the
torch backend. Same KV cache layout as the torch backend; the same sliding
window and soft cap, as compile-time constants of the kernel. Left out: fp8 KV
caches, ALiBi, sinks, the metadata builder (and with it the
preallocated split-softmax buffers) and cudagraph support.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kernels.unified_attention import MIN_LAUNCH_GRID_SIZE_2D, use_split_softmax
from tracevllm import _custom_ops as ops
from tracevllm.attention.backends.abstract import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionType,
)

if TYPE_CHECKING:
    from tracevllm.model_executor.layers.attention import Attention


class TritonAttentionImpl(AttentionImpl):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
    ) -> None:
        super().__init__(
            num_heads,
            head_size,
            scale,
            num_kv_heads,
            alibi_slopes,
            sliding_window,
            kv_cache_dtype,
            logits_soft_cap,
            attn_type,
            kv_sharing_target_layer_name,
        )
        # The 2D grid has at least num_seqs * num_kv_heads programs; below
        # MIN_LAUNCH_GRID_SIZE_2D of them, a decode-only step splits each
        # context into segments instead (vLLM's TritonAttentionMetadataBuilder).
        self.seq_threshold_3D = MIN_LAUNCH_GRID_SIZE_2D // num_kv_heads

    def launch_name(self, attn_metadata: AttentionMetadata) -> str:
        num_seqs = attn_metadata.seq_lens.shape[0]
        if use_split_softmax(attn_metadata.max_query_len, num_seqs, self.seq_threshold_3D):
            return "kernel_unified_attention 3D (split-softmax) + reduce_segments"
        return "kernel_unified_attention 2D"

    def do_kv_cache_update(
        self,
        layer: Attention,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_size]
        slot_mapping: torch.Tensor,  # [num_tokens]
    ) -> None:
        ops.reshape_and_cache_flash(key, value, kv_cache, slot_mapping, backend="triton")

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
        # Unlike the torch backend, the kernel reads query_start_loc and
        # seq_lens on the device: no host copy, no sync.
        n = attn_metadata.num_actual_tokens
        ops.unified_attention(
            q=query[:n],
            kv_cache=kv_cache,
            out=output[:n],
            query_start_loc=attn_metadata.query_start_loc,
            seq_lens=attn_metadata.seq_lens,
            max_query_len=attn_metadata.max_query_len,
            max_seq_len=attn_metadata.max_seq_len,
            block_table=attn_metadata.block_table,
            softmax_scale=self.scale,
            backend="triton",
            seq_threshold_3D=self.seq_threshold_3D,
            window_size=self.sliding_window,
            softcap=self.logits_soft_cap,
        )
        return output


class TritonAttentionBackend(AttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "TRITON_ATTN"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TritonAttentionImpl


def check_triton_usable(device_type: str) -> None:
    """Raise, saying what to do, if the Triton kernels cannot run on ``device_type``."""
    if not ops.HAS_TRITON:
        raise RuntimeError(
            "attention_backend='triton' needs Triton: pip install 'tracevllm[triton]', "
            "or use attention_backend='torch'."
        )
    if device_type == "cuda" or ops.interpreter_active():
        return
    raise RuntimeError(
        f"attention_backend='triton' on {device_type!r} runs only in Triton's interpreter: "
        "set TRITON_INTERPRET=1 in the environment before starting Python (slow; for "
        "tests), or use attention_backend='torch'. (Setting it after torch or triton "
        "is imported is too late: Triton reads it at import.)"
    )
