"""The pool of KV cache blocks: allocate, free, and cache by hash.

Mirrors vllm/v1/core/block_pool.py (``BlockHashToBlockMap``, ``BlockPool``),
with vLLM's signatures: ``BlockPool(num_gpu_blocks, enable_caching,
hash_block_size)``, ``get_cached_block(block_hash, kv_cache_group_ids)``,
``cache_full_blocks(..., kv_cache_group_id, block_mask=None)``. Left out: KV
cache events (``enable_kv_cache_events``, ``take_events``), the metrics
collector, and caching a group whose
block size is a multiple of ``hash_block_size`` (hybrid groups). Added, for
stats and views: ``num_cached_blocks``, ``get_num_usable_blocks`` and
``peek_free_blocks``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from tracevllm.core.kv_cache_utils import (
    BlockHash,
    BlockHashWithGroupId,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    make_block_hash_with_group_id,
)
from tracevllm.labs import lab_hook
from tracevllm.logger import init_logger

if TYPE_CHECKING:
    from tracevllm.request import Request

logger = init_logger(__name__)


class BlockHashToBlockMap:
    """The prefix cache: each key (block hash + group id) to the blocks cached
    under it, free or held.

    One key may name several blocks: two requests can compute the same block
    at once, and blocks are never merged, so that block tables stay
    append-only. As in vLLM, a key holds a bare block while it has one (the
    common case, no inner dict to build or collect) and a ``{block_id:
    block}`` dict once it has two or more.
    """

    def __init__(self) -> None:
        self._cache: dict[BlockHashWithGroupId, KVCacheBlock | dict[int, KVCacheBlock]] = {}
        # tracevllm's: how many blocks the map holds (len() counts keys), for stats.
        self.num_blocks = 0

    def get_one_block(self, key: BlockHashWithGroupId) -> KVCacheBlock | None:
        """Any block cached under ``key`` (the first, if several)."""
        blocks = self._cache.get(key)
        if blocks is None or isinstance(blocks, KVCacheBlock):
            return blocks
        return next(iter(blocks.values()))

    def insert(self, key: BlockHashWithGroupId, block: KVCacheBlock) -> None:
        blocks = self._cache.get(key)
        if blocks is None:
            self._cache[key] = block
        elif isinstance(blocks, KVCacheBlock):
            self._cache[key] = {blocks.block_id: blocks, block.block_id: block}
        else:
            blocks[block.block_id] = block
        self.num_blocks += 1

    def pop(self, key: BlockHashWithGroupId, block_id: int) -> KVCacheBlock | None:
        """Take block ``block_id`` out from under ``key``; None if it is not there."""
        blocks = self._cache.pop(key, None)
        if blocks is None:
            return None
        if isinstance(blocks, KVCacheBlock):
            if blocks.block_id == block_id:
                self.num_blocks -= 1
                return blocks
            self._cache[key] = blocks  # another block under this key: put it back
            return None
        block = blocks.pop(block_id, None)
        if blocks:
            self._cache[key] = blocks
        if block is not None:
            self.num_blocks -= 1
        return block

    def __len__(self) -> int:
        return len(self._cache)


class BlockPool:
    """Every KV block, the free ones in eviction order, and the prefix cache.

    ``hash_block_size`` is the block size the request's hashes were computed
    at; tracevllm's one group allocates at that size.
    """

    def __init__(self, num_gpu_blocks: int, enable_caching: bool, hash_block_size: int) -> None:
        assert isinstance(num_gpu_blocks, int) and num_gpu_blocks > 0
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.blocks = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        # Initially in block-id order; from then on in eviction (LRU) order.
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # Full, hashed blocks: held by requests or free but not yet evicted.
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        # Block 0 pads block tables (vLLM uses it for skipped sliding-window
        # blocks); it is taken out once and never counted as usable.
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True

    def get_cached_block(
        self, block_hash: BlockHash, kv_cache_group_ids: list[int]
    ) -> list[KVCacheBlock] | None:
        """A block cached under this hash for each of the groups, or None if
        any group misses."""
        cached_blocks = []
        for group_id in kv_cache_group_ids:
            key = make_block_hash_with_group_id(block_hash, group_id)
            block = self.cached_block_hash_to_block.get_one_block(key)
            if block is None:
                return None
            cached_blocks.append(block)
        return cached_blocks

    def cache_full_blocks(
        self,
        request: Request,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: list[bool] | None = None,
    ) -> None:
        """Give ``blocks[num_cached_blocks:num_full_blocks]`` their keys and
        enter them in the cache. The hashes were computed by the request's
        block hasher when its tokens arrived. Null blocks, and blocks whose
        ``block_mask`` entry is False (a sliding window's blocks that can
        never serve a hit), are skipped."""
        if num_cached_blocks >= num_full_blocks:
            return
        assert len(request.block_hashes) >= num_full_blocks, (
            f"request {request.request_id} has {len(request.block_hashes)} block hashes, "
            f"{num_full_blocks} needed: was it built with a block hasher?"
        )
        # vLLM regroups the hashes when a group's blocks are a multiple of
        # hash_block_size (hybrid groups); tracevllm's one group hashes at its size.
        assert block_size == self.hash_block_size, (
            f"block_size {block_size} != hash_block_size {self.hash_block_size}"
        )
        new_full_blocks = blocks[num_cached_blocks:num_full_blocks]
        assert block_mask is None or len(block_mask) == len(new_full_blocks)
        for i, block in enumerate(new_full_blocks):
            if block.is_null or (block_mask is not None and not block_mask[i]):
                continue
            key = make_block_hash_with_group_id(
                request.block_hashes[num_cached_blocks + i], kv_cache_group_id
            )
            block.block_hash = key
            self.cached_block_hash_to_block.insert(key, block)

    @lab_hook("get_new_blocks")  # lab 08: chapters/08-free-block-queue
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop blocks from the head of the free queue (the least recently used).

        A popped block may still carry the hash of what it held before: that
        cache entry is evicted now, since its contents are about to be
        overwritten.
        """
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        ret = self.free_block_queue.popleft_n(num_blocks)
        for block in ret:
            if self.enable_caching:
                self._maybe_evict_cached_block(block)
            assert block.ref_cnt == 0
            block.ref_cnt += 1
        return ret

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """Take the block out of the prefix cache, if it is in it; True if it was."""
        block_hash = block.block_hash
        if block_hash is None:
            return False
        if self.cached_block_hash_to_block.pop(block_hash, block.block_id) is None:
            return False
        block.reset_hash()
        return True

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Take these blocks out of the prefix cache (a KV connector's blocks
        that failed to load). Only the hash goes: a block a request still
        holds stays with it, and goes back to the free queue when freed."""
        for block_id in block_ids:
            assert block_id < len(self.blocks), (
                f"Invalid block_id {block_id} >= {len(self.blocks)}. "
                f"This indicates a bug in the KV connector - workers should "
                f"only report block IDs that were allocated by the scheduler."
            )
            self._maybe_evict_cached_block(self.blocks[block_id])

    # --8<-- [start:touch_and_free]
    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """A prefix-cache hit: take the blocks out of the free queue if no one
        held them (so they cannot be evicted), and add a reference."""
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference; blocks no one holds go to the free queue's tail,
        in the given order (first = evicted first). They keep their hash, so
        they stay prefix-cache hits until reused."""
        blocks = list(ordered_blocks)
        for block in blocks:
            block.ref_cnt -= 1
        self.free_block_queue.append_n([b for b in blocks if b.ref_cnt == 0 and not b.is_null])

    # --8<-- [end:touch_and_free]

    def reset_prefix_cache(self) -> bool:
        """Forget every hash. Only possible when no request holds a block."""
        num_used_blocks = self.num_gpu_blocks - self.get_num_free_blocks()
        if num_used_blocks != 1:  # the null block is always in use
            logger.warning(
                "Failed to reset prefix cache because some blocks (%d) are not freed yet",
                num_used_blocks - 1,
            )
            return False
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        for block in self.blocks:
            block.reset_hash()
        return True

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks (the null block excluded) held by requests."""
        total_gpu_blocks = self.num_gpu_blocks - 1
        if not total_gpu_blocks:
            return 0.0
        return 1.0 - self.get_num_free_blocks() / total_gpu_blocks

    # --- tracevllm's, for stats and views ------------------------------------
    def get_num_usable_blocks(self) -> int:
        """Blocks requests can hold: all but the null block (block 0)."""
        return self.num_gpu_blocks - 1

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the prefix cache, held or free."""
        return self.cached_block_hash_to_block.num_blocks

    def peek_free_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """The next ``num_blocks`` blocks ``get_new_blocks`` would hand out,
        head first, without walking the whole queue."""
        ret: list[KVCacheBlock] = []
        block = self.free_block_queue.fake_free_list_head.next_free_block
        while block is not None and block.block_id >= 0 and len(ret) < num_blocks:
            ret.append(block)
            block = block.next_free_block
        return ret
