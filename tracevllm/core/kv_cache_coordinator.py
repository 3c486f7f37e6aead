"""One KV cache manager per KV cache group, driven together.

Mirrors vllm/v1/core/kv_cache_coordinator.py (``KVCacheCoordinator``,
``KVCacheCoordinatorNoPrefixCache``, ``UnitaryKVCacheCoordinator``,
``HybridKVCacheCoordinator``, ``get_kv_cache_coordinator``). The coordinator
owns the ``BlockPool`` and a ``SingleTypeKVCacheManager`` per group
(``single_type_managers``), and asks each the same question: how many blocks,
allocate, cache, free. A Llama has one group of full-attention layers: one
``FullAttentionManager`` (``UnitaryKVCacheCoordinator``). Gemma-2's
alternating sliding-window and full layers make two groups, drawing blocks
from the one pool; their prefix hit is the longest length every group agrees
on (``HybridKVCacheCoordinator``). Left out: eagle groups, cross-attention's
encoder blocks, groups of different block sizes (hashes regrouped at a
coarser size: ``BlockHashListWithBlockSize``), KV cache events and context
parallelism.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from math import lcm
from typing import TYPE_CHECKING

from tracevllm.core.block_pool import BlockPool
from tracevllm.core.kv_cache_utils import BlockHash, KVCacheBlock
from tracevllm.core.single_type_kv_cache_manager import (
    SingleTypeKVCacheManager,
    get_manager_for_kv_cache_spec,
)
from tracevllm.kv_cache_interface import FullAttentionSpec

if TYPE_CHECKING:
    from tracevllm.kv_cache_interface import KVCacheConfig, KVCacheSpec
    from tracevllm.request import Request


class KVCacheCoordinator(ABC):
    """The KV cache of every group: one call here is one call per manager."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        max_num_batched_tokens: int,
        enable_caching: bool,
        hash_block_size: int,
    ) -> None:
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(
            num_gpu_blocks=kv_cache_config.num_blocks,
            enable_caching=enable_caching,
            hash_block_size=hash_block_size,
        )
        self.single_type_managers = tuple(
            get_manager_for_kv_cache_spec(
                kv_cache_spec=group.kv_cache_spec,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len,
                block_pool=self.block_pool,
                enable_caching=enable_caching,
                kv_cache_group_id=i,
            )
            for i, group in enumerate(kv_cache_config.kv_cache_groups)
        )

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
        num_encoder_tokens: int,
        total_computed_tokens: int,
        num_tokens_main_model: int,
    ) -> int:
        """Free blocks the request needs, summed over the groups (they share one pool)."""
        assert num_encoder_tokens == 0, "tracevllm has no encoder-decoder models"
        return sum(
            manager.get_num_blocks_to_allocate(
                request_id,
                num_tokens,
                new_computed_blocks[i],
                total_computed_tokens,
                num_tokens_main_model,
            )
            for i, manager in enumerate(self.single_type_managers)
        )

    def allocate_new_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        for i, manager in enumerate(self.single_type_managers):
            manager.allocate_new_computed_blocks(
                request_id,
                new_computed_blocks[i],
                num_local_computed_tokens,
                num_external_computed_tokens,
            )

    def allocate_new_blocks(
        self,
        request_id: str,
        num_tokens: int,
        num_tokens_main_model: int,
        num_encoder_tokens: int = 0,
    ) -> tuple[list[KVCacheBlock], ...]:
        return tuple(
            manager.allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)
            for manager in self.single_type_managers
        )

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        for manager in self.single_type_managers:
            manager.cache_blocks(request, num_computed_tokens)

    def free(self, request_id: str) -> None:
        for manager in self.single_type_managers:
            manager.free(request_id)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [
            manager.get_num_common_prefix_blocks(running_request_id)
            for manager in self.single_type_managers
        ]

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        for manager in self.single_type_managers:
            manager.remove_skipped_blocks(request_id, total_computed_tokens)

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        return tuple(
            manager.req_to_blocks.get(request_id) or [] for manager in self.single_type_managers
        )

    @abstractmethod
    def find_longest_cache_hit(
        self, block_hashes: list[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """The hit blocks of every group, and how many tokens they hold."""


class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):
    """Prefix caching off: no hits, no shared prefix."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        max_num_batched_tokens: int,
        hash_block_size: int,
    ) -> None:
        super().__init__(
            kv_cache_config, max_model_len, max_num_batched_tokens, False, hash_block_size
        )
        self.num_single_type_manager = len(self.single_type_managers)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [0] * self.num_single_type_manager

    def find_longest_cache_hit(
        self, block_hashes: list[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        return tuple([] for _ in range(self.num_single_type_manager)), 0


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """One KV cache group: the model's layers all have one kind of attention."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        max_num_batched_tokens: int,
        enable_caching: bool,
        hash_block_size: int,
    ) -> None:
        super().__init__(
            kv_cache_config, max_model_len, max_num_batched_tokens, enable_caching, hash_block_size
        )
        assert len(kv_cache_config.kv_cache_groups) == 1, "one KV cache group"
        self.kv_cache_spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        self.block_size = self.kv_cache_spec.block_size
        assert not enable_caching or hash_block_size == self.block_size, (
            "UnitaryKVCacheCoordinator assumes hash_block_size == block_size"
        )

    def find_longest_cache_hit(
        self, block_hashes: list[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        hit_blocks = self.single_type_managers[0].find_longest_cache_hit(
            block_hashes=block_hashes,
            max_length=max_cache_hit_length,
            kv_cache_group_ids=[0],
            block_pool=self.block_pool,
            kv_cache_spec=self.kv_cache_spec,
            use_eagle=False,
            alignment_tokens=self.block_size,
        )
        return hit_blocks, len(hit_blocks[0]) * self.block_size


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Several KV cache groups of different kinds (e.g. full + sliding window)."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        max_num_batched_tokens: int,
        enable_caching: bool,
        hash_block_size: int,
    ) -> None:
        super().__init__(
            kv_cache_config, max_model_len, max_num_batched_tokens, enable_caching, hash_block_size
        )
        self.hash_block_size = hash_block_size
        assert all(
            g.kv_cache_spec.block_size == hash_block_size for g in kv_cache_config.kv_cache_groups
        ), "tracevllm's groups allocate at the hash block size"
        self.verify_and_split_kv_cache_groups()

    def verify_and_split_kv_cache_groups(self) -> None:
        """Gather the groups of one spec (the same kind of attention), full attention first.

        Groups with the same spec find the same hit; they are asked once.
        Full attention goes first because its left-to-right walk is cheap and
        bounds the length the others need to search.
        """
        attention_groups: list[tuple[KVCacheSpec, list[int], type[SingleTypeKVCacheManager]]] = []
        for i, group in enumerate(self.kv_cache_config.kv_cache_groups):
            manager_cls = type(self.single_type_managers[i])
            for spec, group_ids, existing_cls in attention_groups:
                if spec == group.kv_cache_spec:
                    assert manager_cls is existing_cls
                    group_ids.append(i)
                    break
            else:
                attention_groups.append((group.kv_cache_spec, [i], manager_cls))
        assert len(attention_groups) > 1, (
            "HybridKVCacheCoordinator requires at least two attention groups."
        )
        self.attention_groups = sorted(
            attention_groups, key=lambda x: not isinstance(x[0], FullAttentionSpec)
        )
        # A hit is whole blocks of every group.
        self.lcm_block_size = lcm(*(spec.block_size for spec, _, _ in attention_groups))

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        # Hits are multiples of lcm_block_size tokens; cache at that grain.
        num_computed_tokens = num_computed_tokens // self.lcm_block_size * self.lcm_block_size
        for manager in self.single_type_managers:
            manager.cache_blocks(request, num_computed_tokens, alignment_tokens=self.lcm_block_size)

    # --8<-- [start:hybrid_find_longest_cache_hit]
    def find_longest_cache_hit(
        self, block_hashes: list[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """The longest length every kind of attention can take as a hit.

        Each kind, in turn, either accepts the candidate length or cuts it;
        a cut sends the search round again (the length only shrinks, so it
        stops). Full attention's hits are closed downwards (a shorter prefix
        of a hit is a hit): it is searched once and then only trimmed. With
        one full and one other kind, one round suffices.
        """
        num_groups = len(self.kv_cache_config.kv_cache_groups)
        hit_length = max_cache_hit_length
        hit_blocks_by_group: list[list[KVCacheBlock] | None] = [None] * num_groups
        is_simple_hybrid = len(self.attention_groups) == 2 and isinstance(
            self.attention_groups[0][0], FullAttentionSpec
        )
        while True:
            curr_hit_length = hit_length
            for spec, group_ids, manager_cls in self.attention_groups:
                if (
                    isinstance(spec, FullAttentionSpec)
                    and hit_blocks_by_group[group_ids[0]] is not None
                ):
                    curr_hit_length = curr_hit_length // spec.block_size * spec.block_size
                    continue
                hit_blocks = manager_cls.find_longest_cache_hit(
                    block_hashes=block_hashes,
                    max_length=curr_hit_length,
                    kv_cache_group_ids=group_ids,
                    block_pool=self.block_pool,
                    kv_cache_spec=spec,
                    use_eagle=False,
                    alignment_tokens=self.lcm_block_size,
                )
                curr_hit_length = len(hit_blocks[0]) * spec.block_size
                for group_id, blocks in zip(group_ids, hit_blocks, strict=True):
                    hit_blocks_by_group[group_id] = blocks
            if curr_hit_length >= hit_length:
                break
            hit_length = curr_hit_length
            if is_simple_hybrid:
                break
        # Full attention's blocks trimmed to the agreed length.
        spec, group_ids, _ = self.attention_groups[0]
        if isinstance(spec, FullAttentionSpec):
            for group_id in group_ids:
                if (full_blocks := hit_blocks_by_group[group_id]) is not None:
                    del full_blocks[hit_length // spec.block_size :]
        return tuple(b if b is not None else [] for b in hit_blocks_by_group), hit_length

    # --8<-- [end:hybrid_find_longest_cache_hit]


def get_kv_cache_coordinator(
    kv_cache_config: KVCacheConfig,
    max_model_len: int,
    max_num_batched_tokens: int,
    enable_caching: bool,
    hash_block_size: int,
) -> KVCacheCoordinator:
    if not enable_caching:
        return KVCacheCoordinatorNoPrefixCache(
            kv_cache_config, max_model_len, max_num_batched_tokens, hash_block_size
        )
    if len(kv_cache_config.kv_cache_groups) == 1:
        return UnitaryKVCacheCoordinator(
            kv_cache_config, max_model_len, max_num_batched_tokens, enable_caching, hash_block_size
        )
    return HybridKVCacheCoordinator(
        kv_cache_config, max_model_len, max_num_batched_tokens, enable_caching, hash_block_size
    )
