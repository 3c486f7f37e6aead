"""The blocks of one KV cache group: which each request holds, how many more
it needs, and which are prefix-cache hits.

Mirrors vllm/v1/core/single_type_kv_cache_manager.py
(``SingleTypeKVCacheManager``, ``FullAttentionManager``,
``SlidingWindowManager``, ``spec_manager_map``,
``get_manager_for_kv_cache_spec``). One manager per KV cache group; the kind
of attention decides how many blocks a request keeps and what counts as a
hit. ``SlidingWindowManager`` overrides ``get_num_skipped_tokens`` (tokens
before the window: ``remove_skipped_blocks`` frees their blocks and puts the
null block in their place, so a long generation holds at most
``cdiv(W, block_size) + 1`` blocks) and ``find_longest_cache_hit`` (a hit
needs only the window's blocks, found right to left).

Left out: the other managers (chunked local, Mamba, cross-attention, sink),
KV connectors' external tokens (the ``num_external_computed_tokens``
arguments stay, always 0 here), the admission cap of recycling managers
(vLLM applies it only with ``full_sequence_must_fit``, which tracevllm leaves
out), eagle's dropped last block, context parallelism, and
``new_block_ids`` (blocks to zero for Mamba). Added, for views: each
manager counts the blocks it freed because they fell out of the window
(``num_skipped_blocks_freed``).
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tracevllm.core.block_pool import BlockPool
from tracevllm.core.kv_cache_utils import BlockHash, KVCacheBlock
from tracevllm.kv_cache_interface import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
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
        # Blocks remove_skipped_blocks gave back so far (tracevllm's, for views).
        self.num_skipped_blocks_freed = 0

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
        ones as null blocks. They are cached already. A KV connector's tokens
        (``num_external_computed_tokens``) get fresh blocks after them."""
        if request_id in self.num_cached_block:
            assert len(new_computed_blocks) == 0, "a running request has no new prefix hits"
            return
        req_blocks = self.req_to_blocks[request_id]
        assert len(req_blocks) == 0
        num_total_computed_tokens = num_local_computed_tokens + num_external_computed_tokens
        num_skipped_tokens = self.get_num_skipped_tokens(num_total_computed_tokens)
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
        if num_external_computed_tokens > 0:
            # Fresh blocks for a KV connector's tokens (cached once they hold them).
            req_blocks.extend(
                self.block_pool.get_new_blocks(
                    cdiv(num_total_computed_tokens, self.block_size) - len(req_blocks)
                )
            )

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

    def cache_blocks(
        self, request: Request, num_tokens: int, alignment_tokens: int | None = None
    ) -> None:
        """Enter the request's blocks that are full at ``num_tokens`` into the
        prefix cache (those not entered yet). ``alignment_tokens``: the hybrid
        coordinator's hit alignment; past this group's block size, a sliding
        window caches only the blocks a hit can use."""
        num_cached_blocks = self.num_cached_block.get(request.request_id, 0)
        num_full_blocks = num_tokens // self.block_size
        if num_cached_blocks >= num_full_blocks:
            return
        block_mask = None
        if alignment_tokens is not None and alignment_tokens > self.block_size:
            block_mask = self._cache_block_mask(
                num_cached_blocks, num_full_blocks, alignment_tokens
            )
        self.block_pool.cache_full_blocks(
            request=request,
            blocks=self.req_to_blocks[request.request_id],
            num_cached_blocks=num_cached_blocks,
            num_full_blocks=num_full_blocks,
            block_size=self.block_size,
            kv_cache_group_id=self.kv_cache_group_id,
            block_mask=block_mask,
        )
        self.num_cached_block[request.request_id] = num_full_blocks

    def _cache_block_mask(
        self, num_cached_blocks: int, num_full_blocks: int, alignment_tokens: int
    ) -> list[bool] | None:
        """Which of the new full blocks to cache; None: all (full attention)."""
        return None

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
        self.num_skipped_blocks_freed += len(removed_blocks)
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


class SlidingWindowManager(SingleTypeKVCacheManager):
    """A sliding window of W tokens: the query at position p reads keys
    p - W + 1 .. p, so every block wholly before that can go."""

    def __init__(self, kv_cache_spec: SlidingWindowSpec, **kwargs: Any) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.sliding_window = kv_cache_spec.sliding_window

    # --8<-- [start:sliding_window_cache_hit]
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
        """The longest prefix whose last ``cdiv(W - 1, block_size)`` blocks are cached.

        The next token's window needs only the W - 1 tokens before it, so the
        blocks before them may be gone (evicted, or never cached): they come
        back as the null block. Walked right to left, the first run of enough
        contiguous hits ends the search; without one, the hit is the run of
        leading blocks (the window reaches back to token 0). E.g. block size
        4, W = 8 (2 blocks), cached blocks 2 and 3 of 6: [NULL, NULL, b2, b3].
        """
        assert isinstance(kv_cache_spec, SlidingWindowSpec)
        assert not use_eagle, "tracevllm has no eagle drafter"
        block_size = kv_cache_spec.block_size
        # -1: the next token itself is the window's last.
        num_contiguous_needed = cdiv(kv_cache_spec.sliding_window - 1, block_size)
        max_num_blocks = max_length // block_size
        null = block_pool.null_block
        computed_blocks = tuple([null] * max_num_blocks for _ in kv_cache_group_ids)
        num_contiguous = 0
        match_found = False
        for i in range(max_num_blocks - 1, -1, -1):
            cached = block_pool.get_cached_block(block_hashes[i], kv_cache_group_ids)
            if cached is None:
                num_contiguous = 0
                continue
            # The run must end where the hit may end: on an aligned length.
            if num_contiguous == 0 and (i + 1) * block_size % alignment_tokens != 0:
                continue
            for computed, block in zip(computed_blocks, cached, strict=True):
                computed[i] = block
            num_contiguous += 1
            if num_contiguous >= num_contiguous_needed:
                # Drop what lies past the run: [NULL, b1, b2, NULL] -> [NULL, b1, b2].
                for computed in computed_blocks:
                    del computed[i + num_contiguous :]
                match_found = True
                break
        if not match_found:
            # The leading run (the loop stopped at block 0) is a hit by itself.
            for computed in computed_blocks:
                del computed[num_contiguous:]
            while len(computed_blocks[0]) * block_size % alignment_tokens != 0:
                for computed in computed_blocks:
                    computed.pop()
        return computed_blocks

    # --8<-- [end:sliding_window_cache_hit]

    def _cache_block_mask(
        self, num_cached_blocks: int, num_full_blocks: int, alignment_tokens: int
    ) -> list[bool] | None:
        """Of each ``alignment_tokens`` segment, a hit reads only the last
        ``cdiv(W - 1, block_size)`` blocks: the others need no cache entry."""
        per_segment = alignment_tokens // self.block_size
        tail = cdiv(self.sliding_window - 1, self.block_size)
        if tail >= per_segment:
            return None
        skip = per_segment - tail
        return [i % per_segment >= skip for i in range(num_cached_blocks, num_full_blocks)]

    # --8<-- [start:get_num_skipped_tokens]
    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens before the next token's window.

        E.g. W = 4, 7 tokens computed: token 7 comes next and sees 4 .. 7, so
        tokens 0 .. 3 are skipped: ``7 - 4 + 1 = 4``.
        """
        return max(0, num_computed_tokens - self.sliding_window + 1)

    # --8<-- [end:get_num_skipped_tokens]

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        # A window's leading blocks are null blocks; vLLM answers 0 (no
        # cascade attention with sliding windows yet), and so does tracevllm.
        return 0


spec_manager_map: dict[type[KVCacheSpec], type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
}


def get_manager_for_kv_cache_spec(
    kv_cache_spec: KVCacheSpec, max_num_batched_tokens: int, max_model_len: int, **kwargs: Any
) -> SingleTypeKVCacheManager:
    """The manager for this kind of attention (vLLM also gives recycling kinds
    an admission cap from the two lengths)."""
    manager_class = spec_manager_map[type(kv_cache_spec)]
    return manager_class(kv_cache_spec, **kwargs)
