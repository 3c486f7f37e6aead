"""What the KV cache looks like: per-layer specs, the groups that share a
block table, and the config the engine sizes from them.

Mirrors vllm/v1/kv_cache_interface.py (``KVCacheSpec``, ``AttentionSpec``,
``FullAttentionSpec``, ``SlidingWindowSpec``, ``UniformTypeKVCacheSpecs``,
``KVCacheTensor``, ``KVCacheGroupSpec``, ``KVCacheConfig``). Left out: the
chunked-local, MLA, Mamba, cross-attention and sink specs, KV cache
quantization (``kv_quant_mode``) and page padding, ``head_size_v``, the
``sliding_window`` a ``FullAttentionSpec`` carries when vLLM's hybrid manager
is disabled, and context parallelism in ``max_memory_usage_bytes``.

No torch at run time: the scheduler and the KV manager import this module,
and they never import torch (DESIGN.md). ``dtype`` is a ``torch.dtype`` (as
in vLLM) or its name (``"float32"``, as tracevllm's ``ModelConfig`` keeps
it); only its size in bytes is read.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

from tracevllm.utils.math_utils import cdiv

if TYPE_CHECKING:
    import torch

    from tracevllm.config import VllmConfig

_DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}


def get_dtype_size(dtype: torch.dtype | str) -> int:
    """Bytes of one element (vLLM: utils/torch_utils.py), without importing torch."""
    if isinstance(dtype, str):
        if dtype not in _DTYPE_SIZES:
            raise ValueError(f"KV cache dtype must be one of {list(_DTYPE_SIZES)}, got {dtype!r}.")
        return _DTYPE_SIZES[dtype]
    return int(dtype.itemsize)


@dataclass(frozen=True)
class KVCacheSpec:
    """The KV cache of one layer: how many tokens a block holds, and what a
    block (a page) costs."""

    block_size: int

    @property
    def page_size_bytes(self) -> int:
        raise NotImplementedError

    def max_memory_usage_bytes(self, vllm_config: VllmConfig) -> int:
        """The most this layer's cache can take for one request."""
        raise NotImplementedError

    @classmethod
    def merge(cls, specs: list[Self]) -> Self:
        """One spec for a group of layers, which must all be alike."""
        assert all(spec == specs[0] for spec in specs[1:]), (
            "All layers in the same KV cache group must be the same."
        )
        return copy.deepcopy(specs[0])


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    num_kv_heads: int
    head_size: int
    dtype: Any  # torch.dtype | str; Any keeps the dataclass free of torch

    @property
    def page_size_bytes(self) -> int:
        # K and V, block_size tokens each.
        return 2 * self.block_size * self.num_kv_heads * self.head_size * get_dtype_size(self.dtype)


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Every token attends to every earlier token: a request keeps a block for
    each ``block_size`` tokens of its length."""

    def max_memory_usage_bytes(self, vllm_config: VllmConfig) -> int:
        max_model_len = vllm_config.model_config.get_max_model_len()
        return cdiv(max_model_len, self.block_size) * self.page_size_bytes


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """Each token attends to the last ``sliding_window`` tokens (itself
    included): the blocks before them are freed (``SlidingWindowManager``)."""

    sliding_window: int

    def max_admission_blocks_per_request(
        self, max_num_batched_tokens: int, max_model_len: int
    ) -> int:
        """The most blocks one request holds at once.

        While a chunk of up to ``max_num_batched_tokens`` is computed, the
        request keeps the window's ``sliding_window - 1`` earlier tokens too,
        never more than ``max_model_len``; +1 because the window need not start
        on a block boundary (block size 4, window [CDEF] of [XXCD][EF]: 2 blocks).
        """
        num_tokens = min(self.sliding_window - 1 + max_num_batched_tokens, max_model_len)
        return cdiv(num_tokens, self.block_size) + 1

    def max_memory_usage_bytes(self, vllm_config: VllmConfig) -> int:
        max_blocks = self.max_admission_blocks_per_request(
            max_num_batched_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
            max_model_len=vllm_config.model_config.get_max_model_len(),
        )
        return max_blocks * self.page_size_bytes


@dataclass(frozen=True)
class UniformTypeKVCacheSpecs(KVCacheSpec):
    """Layers that need the same slots per token but differ in size (with a
    draft model: its layers beside the target's), kept as one group that
    shares one block table; a block is then one page of every layer."""

    kv_cache_specs: dict[str, KVCacheSpec]

    @property
    def page_size_bytes(self) -> int:
        return sum(spec.page_size_bytes for spec in self.kv_cache_specs.values())

    def max_memory_usage_bytes(self, vllm_config: VllmConfig) -> int:
        return sum(
            spec.max_memory_usage_bytes(vllm_config) for spec in self.kv_cache_specs.values()
        )

    @classmethod
    def from_specs(cls, kv_cache_specs: dict[str, KVCacheSpec]) -> Self | None:
        """One spec for these layers if they can share a block table (one block
        size; all full attention, or all one sliding window), else None."""
        specs = list(kv_cache_specs.values())
        if not specs or any(s.block_size != specs[0].block_size for s in specs):
            return None
        first = specs[0]
        if isinstance(first, FullAttentionSpec):
            uniform = all(isinstance(s, FullAttentionSpec) for s in specs)
        elif isinstance(first, SlidingWindowSpec):
            # Sliding windows of one size: the same slots per token.
            uniform = all(
                isinstance(s, SlidingWindowSpec) and s.sliding_window == first.sliding_window
                for s in specs
            )
        else:
            uniform = False
        if not uniform:
            return None
        return cls(block_size=specs[0].block_size, kv_cache_specs=kv_cache_specs)


@dataclass
class KVCacheTensor:
    """One KV cache tensor the model runner allocates, and the layers that use it."""

    size: int  # bytes
    shared_by: list[str]


@dataclass
class KVCacheGroupSpec:
    """Layers that share one block table; the KV manager treats them as one layer."""

    layer_names: list[str]
    kv_cache_spec: KVCacheSpec


@dataclass
class KVCacheConfig:
    """The KV cache of the model: how many blocks, the tensors, the groups."""

    num_blocks: int
    kv_cache_tensors: list[KVCacheTensor]
    # One group per kind of attention (a Llama has one; Gemma-2 two: full and
    # sliding window), each with layers of the same page size.
    kv_cache_groups: list[KVCacheGroupSpec]
