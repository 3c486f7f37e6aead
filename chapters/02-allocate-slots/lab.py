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
    num_external_computed_tokens: int = 0,
    delay_cache_blocks: bool = False,
) -> KVCacheBlocks | None:
    """Make room for ``num_new_tokens`` more tokens of ``request``; None if the
    pool cannot. Returns only the blocks allocated by this call."""
    # (num_external_computed_tokens and delay_cache_blocks come from a KV
    # connector: tokens it fills, and an asynchronous load whose blocks must not
    # be cached yet. The lab's tests pass neither; the disaggregated-prefill
    # chapter reads the engine's version.)
    # TODO 1: num_new_tokens == 0 is a caller's bug: raise ValueError.
    # TODO 2: the prefix hits, one sequence per KV cache group:
    #         new_computed_blocks.blocks, or self.empty_kv_cache_blocks.blocks
    #         when there are none (keep that very object: step 5 tests for it).
    # TODO 3: count tokens. Computed so far: request.num_computed_tokens + the
    #         hits (num_new_computed_tokens), capped at self.max_model_len.
    #         After this step: that + num_new_tokens. Slots needed: that +
    #         num_lookahead_tokens, capped at self.max_model_len again.
    # TODO 4: fit or fail. self.coordinator.get_num_blocks_to_allocate(
    #             request_id=..., num_tokens=<slots needed>,
    #             new_computed_blocks=<the hits>, num_encoder_tokens=0,
    #             total_computed_tokens=<computed so far, uncapped>,
    #             num_tokens_main_model=<tokens after this step>)
    #         counts the free blocks it takes (a hit on a free block counts
    #         too). More than self.block_pool.get_num_free_blocks()? Return
    #         None, having changed nothing.
    # TODO 5: hits first, if there are any:
    #         self.coordinator.allocate_new_computed_blocks(request_id=...,
    #             new_computed_blocks=..., num_local_computed_tokens=<computed
    #             so far, uncapped>, num_external_computed_tokens=0).
    # TODO 6: then new blocks: self.coordinator.allocate_new_blocks(
    #             request_id, <slots needed>, <tokens after this step>).
    # TODO 7: if self.enable_caching: self.coordinator.cache_blocks(request, n)
    #         with n the tokens computed once this step ran (lookahead tokens
    #         excluded, and never more than request.num_tokens).
    # TODO 8: return the new blocks only: self.create_kv_cache_blocks(new_blocks).
    raise NotImplementedError("Lab 02: allocate_slots (see chapters/02-allocate-slots)")
