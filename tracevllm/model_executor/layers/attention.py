"""The attention layer: holds the KV cache, asks the backend to write and read it.

Mirrors vllm/model_executor/layers/attention/attention.py (``Attention``,
``unified_kv_cache_update``, ``unified_attention_with_output``,
``get_attention_context``). The model code never sees the paged cache or the
batch's layout: it hands over flat q/k/v, and the layer finds its metadata in
the forward context under its own ``layer_name``. Left out: torch custom-op
registration (for torch.compile), KV sharing between layers, quantized KV
caches, encoder/cross attention, MLA.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from tracevllm.attention.selector import get_attn_backend
from tracevllm.forward_context import get_forward_context

if TYPE_CHECKING:
    from tracevllm.attention.backends.abstract import AttentionMetadata
    from tracevllm.config import VllmConfig


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        vllm_config: VllmConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        # The key under which this layer's metadata and cache are found.
        self.layer_name = prefix
        backend_name = vllm_config.attention_config.backend if vllm_config else None
        device = vllm_config.device_config.device if vllm_config else "cpu"
        self.attn_backend = get_attn_backend(backend_name, device)
        self.impl = self.attn_backend.get_impl_cls()(num_heads, head_size, scale, num_kv_heads)
        # Bound by ModelRunner.initialize_kv_cache:
        # [num_blocks, 2, block_size, num_kv_heads, head_size]
        self.kv_cache = torch.tensor([])

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads * head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads * head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads * head_size]
    ) -> torch.Tensor:
        num_tokens = query.shape[0]
        output = torch.empty_like(query).view(num_tokens, self.num_heads, self.head_size)
        query = query.view(num_tokens, self.num_heads, self.head_size)
        key = key.view(num_tokens, self.num_kv_heads, self.head_size)
        value = value.view(num_tokens, self.num_kv_heads, self.head_size)
        unified_kv_cache_update(key, value, self.layer_name)
        unified_attention_with_output(query, key, value, output, self.layer_name)
        return output.view(num_tokens, self.num_heads * self.head_size)


def get_attention_context(
    layer_name: str,
) -> tuple[AttentionMetadata, Attention, torch.Tensor, torch.Tensor | None]:
    """(metadata, layer, kv_cache, slot_mapping) of ``layer_name`` for this forward."""
    ctx = get_forward_context()
    assert ctx.attn_metadata is not None, "attention needs metadata in the forward context"
    layer: Attention = ctx.no_compile_layers[layer_name]
    return (
        ctx.attn_metadata[layer_name],
        layer,
        layer.kv_cache,
        ctx.slot_mapping.get(layer_name),
    )


def unified_kv_cache_update(key: torch.Tensor, value: torch.Tensor, layer_name: str) -> None:
    """Write this step's K/V into the paged cache (first half of every attention layer)."""
    _, layer, kv_cache, slot_mapping = get_attention_context(layer_name)
    if slot_mapping is not None:
        layer.impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)


def unified_attention_with_output(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    layer_name: str,
) -> None:
    """Read the paged cache and attend (second half); writes ``output`` in place."""
    attn_metadata, layer, kv_cache, _ = get_attention_context(layer_name)
    layer.impl.forward(layer, query, key, value, kv_cache, attn_metadata, output)
