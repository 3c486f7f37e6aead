"""The attention layer: holds the KV cache, asks the backend to write and read it.

Mirrors vllm/model_executor/layers/attention/attention.py (``Attention`` with
vLLM's constructor, ``get_kv_cache_spec``, ``unified_kv_cache_update``,
``unified_attention_with_output``, ``get_attention_context``, and
kv_transfer_utils.py's ``maybe_transfer_kv_layer``: a KV connector loads a
layer's KV before its attention and saves it after). The model code
never sees the paged cache or the batch's layout: it hands over flat q/k/v,
and the layer finds its metadata in the forward context under its own
``layer_name`` (with several KV cache groups, its group's metadata: its own
block table and slot mapping). A sliding window (``per_layer_sliding_window``,
or the model-wide ``cache_config.sliding_window``) makes the layer's KV cache
a ``SlidingWindowSpec``. The two halves are also torch ops
(``torch.ops.tracevllm.unified_kv_cache_update`` and
``unified_attention_with_output``, registered as vLLM's with a fake
implementation) for torch.compile, which splits the graph at them. Left
out: KV sharing between layers, quantized KV caches, ALiBi,
encoder/cross attention, MLA. tracevllm's older ``vllm_config=`` argument is
still taken (vLLM reads the config being built from ``get_current_vllm_config``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tracevllm import tracing
from tracevllm.attention.backends.abstract import AttentionType
from tracevllm.attention.selector import get_attn_backend
from tracevllm.compilation.config import CompilationMode
from tracevllm.compilation.torch_utils import direct_register_custom_op
from tracevllm.config import get_current_vllm_config
from tracevllm.distributed.kv_transfer.kv_transfer_state import (
    get_kv_transfer_group,
    has_kv_transfer_group,
)
from tracevllm.forward_context import get_forward_context
from tracevllm.kv_cache_interface import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec

if TYPE_CHECKING:
    from tracevllm.attention.backends.abstract import AttentionBackend, AttentionMetadata
    from tracevllm.config import CacheConfig, VllmConfig


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        cache_config: CacheConfig | None = None,
        quant_config: Any = None,
        logits_soft_cap: float | None = None,
        per_layer_sliding_window: int | None = None,
        prefix: str = "",
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        attn_backend: type[AttentionBackend] | None = None,
        vllm_config: VllmConfig | None = None,
    ) -> None:
        super().__init__()
        if quant_config is not None:
            raise NotImplementedError("tracevllm has no quantized attention.")
        vllm_config = vllm_config or get_current_vllm_config()
        if cache_config is None and vllm_config is not None:
            cache_config = vllm_config.cache_config
        # A layer's own window (Gemma-2's alternate layers) before the model's (Mistral).
        sliding_window: int | None = per_layer_sliding_window
        if sliding_window is None and cache_config is not None:
            sliding_window = cache_config.sliding_window
        if num_kv_heads is None:
            num_kv_heads = num_heads
        assert num_heads % num_kv_heads == 0, (
            f"num_heads ({num_heads}) is not divisible by num_kv_heads ({num_kv_heads})"
        )
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.attn_type = attn_type
        # The key under which this layer's metadata and cache are found.
        self.layer_name = prefix
        # "model.layers.7.self_attn.attn" -> 7: tracing records layer 0 by default.
        parts = prefix.split(".")
        self.layer_index = int(parts[parts.index("layers") + 1]) if "layers" in parts else 0
        if attn_backend is None:
            backend_name = vllm_config.attention_config.backend if vllm_config else None
            device = vllm_config.device_config.device if vllm_config else "cpu"
            attn_backend = get_attn_backend(backend_name, device)
        self.attn_backend = attn_backend
        # vLLM calls the torch ops whenever the platform's attention is opaque
        # (CPU, CUDA), compiled or not. tracevllm calls the functions directly
        # when nothing is compiled: an op call costs ~13 µs against 0.4 here, two
        # per layer per step (compilation/torch_utils.py).
        compiled = vllm_config is not None and vllm_config.compilation_config.mode not in (
            None,
            CompilationMode.NONE,
        )
        self.use_direct_call = not compiled
        self.impl = self.attn_backend.get_impl_cls()(
            num_heads,
            head_size,
            scale,
            num_kv_heads,
            alibi_slopes,
            sliding_window,
            "auto",
            logits_soft_cap,
            attn_type,
            kv_sharing_target_layer_name,
        )
        # Bound by ModelRunner.initialize_kv_cache:
        # [num_blocks, 2, block_size, num_kv_heads, head_size]
        self.kv_cache = torch.tensor([])

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        """What this layer's KV cache needs: a sliding window keeps only its last W tokens."""
        block_size = vllm_config.cache_config.block_size
        dtype = getattr(torch, vllm_config.model_config.torch_dtype)
        if self.sliding_window is not None:
            return SlidingWindowSpec(
                block_size=block_size,
                num_kv_heads=self.num_kv_heads,
                head_size=self.head_size,
                dtype=dtype,
                sliding_window=self.sliding_window,
            )
        return FullAttentionSpec(
            block_size=block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype=dtype,
        )

    # --8<-- [start:attention_forward]
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
        if not self.use_direct_call:
            # Opaque to torch.compile: the graph is split here, and the ops run as Python.
            dep = torch.ops.tracevllm.unified_kv_cache_update(key, value, self.layer_name)
            torch.ops.tracevllm.unified_attention_with_output(
                query, key, value, output, self.layer_name, dep
            )
        elif get_forward_context().attn_metadata is None:
            # A dummy run (vLLM's profiling run; the thread count's warm-up
            # probe): nothing cached to write or read.
            output.zero_()
        elif self._is_traced():
            self._forward_traced(query, key, value, output)
        else:
            unified_kv_cache_update(key, value, self.layer_name)
            unified_attention_with_output(query, key, value, output, self.layer_name)
        return output.view(num_tokens, self.num_heads * self.head_size)

    # --8<-- [end:attention_forward]

    def _forward_traced(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor
    ) -> None:
        """The same two calls, each in a span that shows what crossed into the kernel.

        The step's arrays (slot mapping, query starts, sequence lengths) are
        the same for every layer: they go on layer 0's spans only, and the
        other layers' spans (``--detail full``) carry what is their own.
        """
        write, read = self._span_attributes()
        with tracing.span("reshape_and_cache_flash", write):
            unified_kv_cache_update(key, value, self.layer_name)
        with tracing.span("unified_attention", read):
            unified_attention_with_output(query, key, value, output, self.layer_name)

    def _is_traced(self) -> bool:
        return tracing.is_enabled() and (self.layer_index == 0 or tracing.is_full_detail())

    def _span_attributes(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The attributes of the write's span and of the read's."""
        attn_metadata, _, kv_cache, slot_mapping = get_attention_context(self.layer_name)
        layer: dict[str, Any] = {
            "tracevllm.layer": self.layer_index,
            "tracevllm.layer_name": self.layer_name,
        }
        write = {**_WRITE_CODE, **layer, "tracevllm.kv_cache_shape": list(kv_cache.shape)}
        read = {
            **_READ_CODE,
            **layer,
            "tracevllm.block_table_shape": list(attn_metadata.block_table.shape),
            "tracevllm.backend": self.attn_backend.get_name(),
            "tracevllm.attention.launch": self.impl.launch_name(attn_metadata),
        }
        if self.sliding_window is not None:
            read["tracevllm.attention.sliding_window"] = self.sliding_window
        if self.logits_soft_cap is not None:
            read["tracevllm.attention.logits_soft_cap"] = self.logits_soft_cap
        if self.layer_index == 0:
            write["tracevllm.slot_mapping"] = (
                slot_mapping.tolist() if slot_mapping is not None else []
            )
            read["tracevllm.query_start_loc"] = attn_metadata.query_start_loc.tolist()
            read["tracevllm.seq_lens"] = attn_metadata.seq_lens.tolist()
        return write, read


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


# --8<-- [start:maybe_transfer_kv_layer]
def maybe_transfer_kv_layer(func: Callable[..., None]) -> Callable[..., None]:
    """Around a layer's attention, the KV connector's per-layer hooks
    (vllm/model_executor/layers/attention/kv_transfer_utils.py).

    Before: wait until the connector has loaded this layer's KV (the blocks
    of tokens another engine computed), since the attention reads them.
    After: hand the connector this layer's cache to save; this step's K/V
    were written into it just before (``unified_kv_cache_update``). Without a
    connector, or in a forward the connector has no metadata for (another
    in-process engine's), only ``func`` runs.
    """

    @functools.wraps(func)
    def wrapper(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        output: torch.Tensor,
        layer_name: str,
    ) -> None:
        if not has_kv_transfer_group():
            return func(query, key, value, output, layer_name)
        attn_metadata, _, kv_cache, _ = get_attention_context(layer_name)
        connector = get_kv_transfer_group()
        if attn_metadata is None or not connector.has_connector_metadata():
            return func(query, key, value, output, layer_name)
        connector.wait_for_layer_load(layer_name)
        func(query, key, value, output, layer_name)
        connector.save_kv_layer(layer_name, kv_cache, attn_metadata)
        return None

    return wrapper


# --8<-- [end:maybe_transfer_kv_layer]


@maybe_transfer_kv_layer
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


_WRITE_CODE = tracing.code_attributes(unified_kv_cache_update)
_READ_CODE = tracing.code_attributes(unified_attention_with_output)


# --8<-- [start:attention_custom_ops]
def _unified_kv_cache_update_op(
    key: torch.Tensor, value: torch.Tensor, layer_name: str
) -> torch.Tensor:
    """torch.ops.tracevllm.unified_kv_cache_update: the write, traced as in eager.

    Returns an empty tensor that the attention op takes (vLLM's
    ``kv_cache_dummy_dep``), so that a compiled graph keeps the write first.
    """
    ctx = get_forward_context()
    if ctx.attn_metadata is not None:  # None: the compile-time dummy run
        layer: Attention = ctx.no_compile_layers[layer_name]
        if layer._is_traced():
            with tracing.span("reshape_and_cache_flash", layer._span_attributes()[0]):
                unified_kv_cache_update(key, value, layer_name)
        else:
            unified_kv_cache_update(key, value, layer_name)
    return torch.empty(0, dtype=key.dtype, device=key.device)


def _unified_kv_cache_update_fake(
    key: torch.Tensor, value: torch.Tensor, layer_name: str
) -> torch.Tensor:
    return torch.empty(0, dtype=key.dtype, device=key.device)


def _unified_attention_with_output_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    layer_name: str,
    kv_cache_dummy_dep: torch.Tensor | None = None,
) -> None:
    """torch.ops.tracevllm.unified_attention_with_output: the read, writes ``output``."""
    ctx = get_forward_context()
    if ctx.attn_metadata is None:  # a dummy run (compiling, the warm-up): nothing to read
        output.zero_()  # as eager's: a timed dummy step reads no uninitialised memory
        return
    layer: Attention = ctx.no_compile_layers[layer_name]
    if layer._is_traced():
        with tracing.span("unified_attention", layer._span_attributes()[1]):
            unified_attention_with_output(query, key, value, output, layer_name)
    else:
        unified_attention_with_output(query, key, value, output, layer_name)


def _unified_attention_with_output_fake(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    layer_name: str,
    kv_cache_dummy_dep: torch.Tensor | None = None,
) -> None:
    return None


direct_register_custom_op(
    "unified_kv_cache_update",
    _unified_kv_cache_update_op,
    fake_impl=_unified_kv_cache_update_fake,
)
direct_register_custom_op(
    "unified_attention_with_output",
    _unified_attention_with_output_op,
    mutates_args=["output"],
    fake_impl=_unified_attention_with_output_fake,
)
# --8<-- [end:attention_custom_ops]
