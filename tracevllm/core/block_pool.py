"""The pool of KV cache blocks: allocate, free, and cache by hash.

Mirrors vllm/v1/core/block_pool.py (``BlockPool``). Left out: KV cache events
(``take_events``), the metrics collector, ``evict_blocks`` for KV connectors
and group ids in the hash keys (one KV cache group). vLLM's
``BlockHashToBlockMap`` is a plain ``dict[BlockHash, dict[int, KVCacheBlock]]``
here: one hash may name several blocks, because two requests can compute the
same block at once and blocks are never merged (block tables are append-only).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from tracevllm.core.kv_cache_utils import BlockHash, FreeKVCacheBlockQueue, KVCacheBlock
from tracevllm.labs import lab_hook

if TYPE_CHECKING:
    from tracevllm.request import Request


class BlockPool:
    def __init__(self, num_gpu_blocks: int, enable_caching: bool) -> None:
        assert num_gpu_blocks >= 2, "block 0 is the null block: need at least 2 blocks"
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        # Initially in block-id order; from then on in eviction (LRU) order.
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # Full, hashed blocks: held by requests or free but not yet evicted.
        self.cached_block_hash_to_block: dict[BlockHash, dict[int, KVCacheBlock]] = {}
        self.num_cached_blocks = 0
        # Block 0 pads block tables (vLLM uses it for skipped sliding-window
        # blocks); it is taken out once and never counted as usable.
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """Any block cached under this hash (the first, if several)."""
        blocks = self.cached_block_hash_to_block.get(block_hash)
        return next(iter(blocks.values())) if blocks else None

    def cache_full_blocks(
        self,
        request: Request,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
    ) -> None:
        """Give ``blocks[num_cached_blocks:num_full_blocks]`` their hashes and
        enter them in the cache. The hashes were computed by the request's
        block hasher when its tokens arrived; ``block_size`` is kept for vLLM's
        signature (it can hash at a finer block size than it allocates)."""
        if num_cached_blocks >= num_full_blocks:
            return
        assert len(request.block_hashes) >= num_full_blocks, (
            f"request {request.request_id} has {len(request.block_hashes)} block hashes, "
            f"{num_full_blocks} needed: was it built with a block hasher?"
        )
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null:
                continue
            block_hash = request.block_hashes[i]
            block.block_hash = block_hash
            self.cached_block_hash_to_block.setdefault(block_hash, {})[block.block_id] = block
            self.num_cached_blocks += 1

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
        block_hash = block.block_hash
        if block_hash is None:
            return False
        blocks = self.cached_block_hash_to_block.get(block_hash)
        if blocks is None or blocks.pop(block.block_id, None) is None:
            return False
        if not blocks:
            del self.cached_block_hash_to_block[block_hash]
        block.reset_hash()
        self.num_cached_blocks -= 1
        return True

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
        if self.get_num_free_blocks() != self.get_num_usable_blocks():
            return False
        self.cached_block_hash_to_block = {}
        self.num_cached_blocks = 0
        for block in self.blocks:
            block.reset_hash()
        return True

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_num_usable_blocks(self) -> int:
        """Blocks requests can hold: all but the null block (block 0)."""
        return self.num_gpu_blocks - 1

    def get_usage(self) -> float:
        """Fraction of usable blocks (the null block excluded) held by requests."""
        return 1.0 - self.get_num_free_blocks() / self.get_num_usable_blocks()
