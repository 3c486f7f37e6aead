"""Lab 02: KV block allocation. Your version of
``tracevllm.core.kv_cache_manager.KVCacheManager.allocate_slots``.

Read README.md first. Test it with ``make lab CH=02``; watch it manage the KV
cache of real requests with ``TRACEVLLM_LAB=02 make trace PROMPT="..."``.

It is written as a plain function whose first argument is the
``KVCacheManager``: the engine installs it as the method.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tracevllm.core.kv_cache_manager import KVCacheBlocks

if TYPE_CHECKING:  # not at run time: this file is loaded while that module is
    from tracevllm.core.kv_cache_manager import KVCacheManager
    from tracevllm.request import Request


def allocate_slots(
    self: KVCacheManager,
    request: Request,
    num_new_tokens: int,
    num_new_computed_tokens: int = 0,
    new_computed_blocks: KVCacheBlocks | None = None,
    num_lookahead_tokens: int = 0,
) -> KVCacheBlocks | None:
    """Make room for ``num_new_tokens`` more tokens of ``request``; None if the
    pool cannot. Returns only the blocks allocated by this call."""
    # TODO 1: num_new_tokens == 0 is a caller's bug: raise ValueError.
    # TODO 2: count. The request already holds len(self.req_to_blocks.get(id, ()))
    #         blocks; the prefix hits are new_computed_blocks.blocks[0] (or none).
    #         How many tokens need a slot after this step (computed so far + hits
    #         + new + lookahead, capped at self.max_model_len)? How many blocks is
    #         that (cdiv, from tracevllm.core.kv_cache_manager), and how many of
    #         them must be new?
    # TODO 3: a hit on a block no one holds (ref_cnt == 0, not is_null) takes it
    #         out of the free queue, so it costs a free block too. If new blocks
    #         + such hits > self.block_pool.get_num_free_blocks(): return None,
    #         having changed nothing.
    # TODO 4: the request's block list: self.req_to_blocks.setdefault(id, []).
    #         Hits first: self.block_pool.touch(hits), extend the list, and set
    #         self.num_cached_block[id] to its length (they are cached already).
    # TODO 5: self.block_pool.get_new_blocks(n), appended after them.
    # TODO 6: if self.enable_caching: self.cache_blocks(request, ...) with the
    #         tokens computed once this step ran (lookahead tokens excluded,
    #         and never more than request.num_tokens).
    # TODO 7: return the new blocks only, as KVCacheBlocks((new_blocks,)).
    raise NotImplementedError("Lab 02: allocate_slots (see chapters/02-allocate-slots)")
