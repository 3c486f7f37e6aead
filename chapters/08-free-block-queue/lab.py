"""Lab 08: the free-block queue and LRU eviction. Your version of
``tracevllm.core.block_pool.BlockPool.get_new_blocks``.

Read README.md first. Test it with ``make lab CH=08``; watch it hand out the
engine's KV blocks with ``TRACEVLLM_LAB=08 make trace PROMPT="..."``.

It is written as a plain function whose first argument is the ``BlockPool``:
the engine installs it as the method.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # not at run time: this file is loaded while that module is
    from tracevllm.core.block_pool import BlockPool
    from tracevllm.core.kv_cache_utils import KVCacheBlock


def get_new_blocks(self: BlockPool, num_blocks: int) -> list[KVCacheBlock]:
    """Pop blocks from the head of the free queue (the least recently used)."""
    # TODO 1: more blocks than self.get_num_free_blocks()? raise ValueError,
    #         having changed nothing.
    # TODO 2: take num_blocks blocks from the head of self.free_block_queue,
    #         in order (popleft / popleft_n).
    # TODO 3: evict: a popped block may still carry the key (hash + group id)
    #         of what it held. If self.enable_caching and block.block_hash is
    #         set, take the block out of the prefix cache:
    #         self.cached_block_hash_to_block.pop(key, block.block_id) returns
    #         the block if it was cached under that key (None otherwise); if
    #         it was, forget its hash (block.reset_hash()).
    # TODO 4: each block now has one holder: ref_cnt 0 -> 1.
    # TODO 5: return the blocks, head first.
    raise NotImplementedError("Lab 08: get_new_blocks (see chapters/08-free-block-queue)")
