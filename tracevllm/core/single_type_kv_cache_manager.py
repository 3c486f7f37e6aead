"""The blocks of one KV cache group: which each request holds, how many more
it needs, and which are prefix-cache hits.

Mirrors vllm/v1/core/single_type_kv_cache_manager.py
(``SingleTypeKVCacheManager``, ``FullAttentionManager``, ``spec_manager_map``,
``get_manager_for_kv_cache_spec``). One manager per KV cache group; the kind
of attention decides how many blocks a request keeps and what counts as a
hit. tracevllm has full attention only. ``SlidingWindowManager`` would
override ``get_num_skipped_tokens`` (tokens before the window: their blocks
are freed and replaced by the null block in ``remove_skipped_blocks``) and
``find_longest_cache_hit`` (a hit needs only the window's blocks).

Left out: the other managers (sliding window, chunked local, Mamba,
cross-attention, sink), KV connectors' external tokens (the
``num_external_computed_tokens`` arguments stay, always 0 here), the
admission cap of recycling managers, eagle's dropped last block, context
parallelism, and ``new_block_ids`` (blocks to zero for Mamba).
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tracevllm.core.block_pool import BlockPool
from tracevllm.core.kv_cache_utils import BlockHash, KVCacheBlock
from tracevllm.kv_cache_interface import FullAttentionSpec, KVCacheSpec
from tracevllm.utils.math_utils import cdiv

if TYPE_CHECKING:
    from tracevllm.request import Request


class SingleTypeKVCacheManager(ABC):
    """The KV cache logic of one kind of attention layer, for one group."""

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPool,
        enable_caching: bool,
        kv_cache_group_id: int,
    ) -> None:
        self.block_size = kv_cache_spec.block_size
        self.kv_cache_spec = kv_cache_spec
        self.block_pool = block_pool
        self.enable_caching = enable_caching
        # req_id -> its blocks, in token order (the request's block table).
        self.req_to_blocks: defaultdict[str, list[KVCacheBlock]] = defaultdict(list)
        # req_id -> how many of its leading blocks are already in the cache.
        # Only running requests have an entry.
        self.num_cached_block: dict[str, int] = {}
        self.kv_cache_group_id = kv_cache_group_id
        self._null_block = block_pool.null_block

    @classmethod
    def _get_num_evictable_blocks(cls, blocks: Sequence[KVCacheBlock]) -> int:
        return sum(blk.ref_cnt == 0 and not blk.is_null for blk in blocks)

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        num_tokens_main_model: int,
    ) -> int:
        """Free blocks the request needs to hold ``num_tokens`` tokens.

        ``num_tokens`` counts every token that needs a slot, those it already
        has included. A prefix hit on a block no one holds takes that block
        out of the free queue, so it costs a free block just as a new one
        does. ``num_tokens_main_model`` is ``num_tokens`` without the
        lookahead (draft) slots; only vLLM's Mamba manager reads it.
        """
        num_required_blocks = cdiv(num_tokens, self.block_size)
        num_req_blocks = len(self.req_to_blocks.get(request_id, ()))
        if request_id in self.num_cached_block:
            # A running request has no new prefix hits. With drafts rejected,
            # it may hold more blocks than it needs now.
            assert len(new_computed_blocks) == 0
            return max(num_required_blocks - num_req_blocks, 0)

        # Blocks before the attention window need no slot (none, for full attention).
        num_skipped_blocks = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        num_local_computed_blocks = len(new_computed_blocks) + num_req_blocks
        num_new_blocks = max(
            num_required_blocks - max(num_skipped_blocks, num_local_computed_blocks), 0
        )
        num_skipped_new_computed_blocks = max(0, num_skipped_blocks - num_req_blocks)
        num_evictable_blocks = self._get_num_evictable_blocks(
            new_computed_blocks[num_skipped_new_computed_blocks:]
        )
        return num_new_blocks + num_evictable_blocks

    def allocate_new_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """Give a request being admitted its prefix hits: touch them (so they
        cannot be evicted) and put them first in its block table, the skipped
        ones as null blocks. They are cached already."""
        if request_id in self.num_cached_block:
            assert len(new_computed_blocks) == 0, "a running request has no new prefix hits"
            return
        req_blocks = self.req_to_blocks[request_id]
        assert len(req_blocks) == 0
        assert num_external_computed_tokens == 0, "tracevllm has no KV connector"
        num_skipped_tokens = self.get_num_skipped_tokens(num_local_computed_tokens)
        num_skipped_blocks = num_skipped_tokens // self.block_size
        if num_skipped_blocks > 0:
            new_computed_blocks = new_computed_blocks[num_skipped_blocks:]
        if self.enable_caching:
            self.block_pool.touch(new_computed_blocks)
        else:
            assert not new_computed_blocks, "no prefix hits without prefix caching"
        req_blocks.extend([self._null_block] * num_skipped_blocks)
        req_blocks.extend(new_computed_blocks)
        self.num_cached_block[request_id] = len(req_blocks)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[KVCacheBlock]:
        """New blocks from the free queue, so the request holds ``num_tokens`` slots."""
        req_blocks = self.req_to_blocks[request_id]
        num_new_blocks = cdiv(num_tokens, self.block_size) - len(req_blocks)
        if num_new_blocks <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Enter the request's blocks that are full at ``num_tokens`` into the
        prefix cache (those not entered yet)."""
        num_cached_blocks = self.num_cached_block.get(request.request_id, 0)
        num_full_blocks = num_tokens // self.block_size
        if num_cached_blocks >= num_full_blocks:
            return
        self.block_pool.cache_full_blocks(
            request=request,
            blocks=self.req_to_blocks[request.request_id],
            num_cached_blocks=num_cached_blocks,
            num_full_blocks=num_full_blocks,
            block_size=self.block_size,
            kv_cache_group_id=self.kv_cache_group_id,
        )
        self.num_cached_block[request.request_id] = num_full_blocks

    def free(self, request_id: str) -> None:
        """Free the request's blocks, tail first, so that its tail is evicted
        before the prefix it may share with other requests."""
        req_blocks = self.req_to_blocks.pop(request_id, [])
        self.block_pool.free_blocks(reversed(req_blocks))
        self.num_cached_block.pop(request_id, None)

    @abstractmethod
    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        """Leading blocks of this request held by every request that holds KV."""

    @classmethod
    @abstractmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        use_eagle: bool,
        alignment_tokens: int,
    ) -> tuple[list[KVCacheBlock], ...]:
        """The longest prefix of cached blocks, at most ``max_length`` tokens
        and a multiple of ``alignment_tokens``, one list per group in
        ``kv_cache_group_ids`` (skipped blocks as the null block)."""

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        """Free the blocks no attention will read again (before the window),
        putting the null block in their place. Nothing, for full attention."""
        num_skipped_tokens = self.get_num_skipped_tokens(total_computed_tokens)
        if num_skipped_tokens <= 0:
            return
        blocks = self.req_to_blocks[request_id]
        num_skipped_blocks = min(num_skipped_tokens // self.block_size, len(blocks))
        removed_blocks: list[KVCacheBlock] = []
        # Back to front; blocks before the first null one were nulled already.
        for i in range(num_skipped_blocks - 1, -1, -1):
            if blocks[i] is self._null_block:
                break
            removed_blocks.append(blocks[i])
            blocks[i] = self._null_block
        self.block_pool.free_blocks(removed_blocks)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens attention skips once ``num_computed_tokens`` are computed."""
        return 0


class FullAttentionManager(SingleTypeKVCacheManager):
    # --8<-- [start:find_longest_cache_hit]
    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        use_eagle: bool,
        alignment_tokens: int,
    ) -> tuple[list[KVCacheBlock], ...]:
        """Walk the request's block hashes until the first miss."""
        assert isinstance(kv_cache_spec, FullAttentionSpec)
        assert not use_eagle, "tracevllm has no eagle drafter"
        computed_blocks: tuple[list[KVCacheBlock], ...] = tuple([] for _ in kv_cache_group_ids)
        block_size = kv_cache_spec.block_size
        # Hashes are chained: after the first miss no later block can hit.
        for block_hash in itertools.islice(block_hashes, max_length // block_size):
            cached = block_pool.get_cached_block(block_hash, kv_cache_group_ids)
            if cached is None:
                break
            for computed, block in zip(computed_blocks, cached, strict=True):
                computed.append(block)
        # A hybrid model's hit must be whole blocks of every group.
        while len(computed_blocks[0]) * block_size % alignment_tokens != 0:
            for computed in computed_blocks:
                computed.pop()
        return computed_blocks

    # --8<-- [end:find_longest_cache_hit]

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        num_common_blocks = 0
        # .get: indexing the defaultdict would give an unknown id an entry.
        for block in self.req_to_blocks.get(running_request_id, []):
            if block.ref_cnt != len(self.req_to_blocks):
                break
            num_common_blocks += 1
        return num_common_blocks


spec_manager_map: dict[type[KVCacheSpec], type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
}


def get_manager_for_kv_cache_spec(
    kv_cache_spec: KVCacheSpec, max_num_batched_tokens: int, max_model_len: int, **kwargs: Any
) -> SingleTypeKVCacheManager:
    """The manager for this kind of attention (vLLM also gives recycling kinds
    an admission cap from the two lengths)."""
    manager_class = spec_manager_map[type(kv_cache_spec)]
    return manager_class(kv_cache_spec, **kwargs)
