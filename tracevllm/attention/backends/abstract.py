"""One interface for every attention backend.

Mirrors vllm/v1/attention/backend.py (``AttentionBackend``, ``AttentionImpl``,
``AttentionMetadata``) and the common fields of the per-backend metadata
(e.g. ``TritonAttentionMetadata`` in v1/attention/backends/triton_attn.py).
Left out: metadata builders (the runner builds the one metadata type
directly, one per KV cache group), cascade attention, cudagraph support levels, KV cache stride
orders, quantized KV caches, encoder and cross attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tracevllm.model_executor.layers.attention import Attention


class AttentionType(StrEnum):
    """vLLM's attention types (v1/attention/backend.py); tracevllm runs decoders only."""

    DECODER = "decoder"


@dataclass(slots=True)
class AttentionMetadata:
    """What the paged read and write need to know about this step's batch.

    The tensors live on the model's device; the ``*_cpu`` copies let a CPU
    backend (and the tracer) read them without a device sync.
    """

    # Tokens in the batch without padding.
    num_actual_tokens: int
    max_query_len: int
    # [num_reqs + 1], int32: request r's query tokens are [qsl[r], qsl[r+1]).
    query_start_loc: torch.Tensor
    max_seq_len: int
    # [num_reqs], int32: tokens in the cache after this step's write.
    seq_lens: torch.Tensor
    # [num_reqs, max_num_blocks_per_req], int32
    block_table: torch.Tensor
    # [num_tokens], int64: cache slot of each token (-1: padding).
    slot_mapping: torch.Tensor
    query_start_loc_cpu: torch.Tensor | None = None
    seq_lens_cpu: torch.Tensor | None = None


class AttentionImpl:
    """Computes attention for one layer (vLLM's ``AttentionImpl``).

    vLLM's constructor: ``sliding_window`` W is kept as flash-attention's
    ``window_size = (W - 1, 0)`` (W - 1 keys to the left, none to the right;
    ``(-1, -1)``: no window), ``logits_soft_cap`` None as 0 (no cap).
    """

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
        if alibi_slopes is not None:
            raise NotImplementedError("tracevllm's attention backends have no ALiBi.")
        if kv_cache_dtype != "auto":
            raise NotImplementedError("tracevllm's KV cache is in the model's dtype.")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError("tracevllm's attention backends are decoder-only.")
        if kv_sharing_target_layer_name is not None:
            raise NotImplementedError("tracevllm has no KV sharing between layers.")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
        # flash-attention's convention, which vLLM keeps: 0 means no soft cap.
        self.logits_soft_cap = 0.0 if logits_soft_cap is None else float(logits_soft_cap)

    def launch_name(self, attn_metadata: AttentionMetadata) -> str:
        """Which kernel launch ``forward`` will take for this batch (for the trace)."""
        return type(self).__name__

    def do_kv_cache_update(
        self,
        layer: Attention,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [num_tokens]
    ) -> None:
        raise NotImplementedError

    def forward(
        self,
        layer: Attention,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        output: torch.Tensor,  # [num_tokens, num_heads, head_size]
    ) -> torch.Tensor:
        raise NotImplementedError


class AttentionBackend:
    """A family of attention kernels and the KV cache layout they share."""

    @staticmethod
    def get_name() -> str:
        raise NotImplementedError

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        raise NotImplementedError

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
    ) -> tuple[int, ...]:
        # K and V of one block sit side by side (the Triton backend's layout;
        # FlashAttention's puts the 2 first: [2, num_blocks, ...]).
        return (num_blocks, 2, block_size, num_kv_heads, head_size)
