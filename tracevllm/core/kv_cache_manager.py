"""The scheduler's view of the KV cache: which blocks each request holds.

Mirrors vllm/v1/core/kv_cache_manager.py (``KVCacheBlocks``,
``KVCacheManager``). vLLM puts two layers between this class and the
``BlockPool``: a ``KVCacheCoordinator`` over the KV cache groups and one
``SingleTypeKVCacheManager`` per group (full attention, sliding window,
mamba, ...). tracevllm has a single full-attention group, so both layers are
folded in here: ``req_to_blocks`` and ``num_cached_block`` are
``FullAttentionManager``'s, and ``get_computed_blocks`` inlines its
``find_longest_cache_hit``. Left out: KV connectors (external computed tokens,
delayed caching), sliding-window block skipping, eagle, KV events, and
``full_sequence_must_fit``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tracevllm.core.block_pool import BlockPool
from tracevllm.core.kv_cache_utils import KVCacheBlock
from tracevllm.labs import lab_hook
from tracevllm.metrics.stats import PrefixCacheStats
from tracevllm.utils.math_utils import cdiv

if TYPE_CHECKING:
    from tracevllm.request import Request


@dataclass
class KVCacheBlocks:
    """What the KV manager hands the scheduler: blocks, one list per KV cache
    group (always one group here), so the scheduler never sees its internals."""

    blocks: tuple[list[KVCacheBlock], ...]

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(a + b for a, b in zip(self.blocks, other.blocks, strict=True)))

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in group] for group in self.blocks)

    def new_empty(self) -> KVCacheBlocks:
        return KVCacheBlocks(tuple([] for _ in self.blocks))


class KVCacheManager:
    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool = True,
        log_stats: bool = False,
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.log_stats = log_stats
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.block_pool = BlockPool(num_gpu_blocks, enable_caching)
        # req_id -> its blocks, in token order (the request's block table).
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # req_id -> how many of its leading blocks are already in the cache.
        self.num_cached_block: dict[str, int] = {}
        self.empty_kv_cache_blocks = KVCacheBlocks(([],))

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The prefix-cache stats since the last call (then start afresh)."""
        if not self.log_stats:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    # --8<-- [start:get_computed_blocks]
    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest run of the request's leading full blocks already in the
        cache, and how many tokens they hold.

        The hit stops one token short of the request: the last token must be
        run through the model to get the logits of the next one. Since hits
        are whole blocks, a fully cached prompt recomputes its whole last block.
        """
        if not self.enable_caching:
            return self.empty_kv_cache_blocks, 0
        max_num_blocks = (request.num_tokens - 1) // self.block_size
        computed_blocks: list[KVCacheBlock] = []
        # Hashes are chained: after the first miss no later block can hit.
        for block_hash in request.block_hashes[:max_num_blocks]:
            cached_block = self.block_pool.get_cached_block(block_hash)
            if cached_block is None:
                break
            computed_blocks.append(cached_block)
        num_computed_tokens = len(computed_blocks) * self.block_size
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.record(
                num_tokens=request.num_tokens,
                num_hits=num_computed_tokens,
                preempted=request.num_preemptions > 0,
            )
        return KVCacheBlocks((computed_blocks,)), num_computed_tokens

    # --8<-- [end:get_computed_blocks]

    # --8<-- [start:allocate_slots]
    @lab_hook("allocate_slots")  # lab 02: chapters/02-allocate-slots
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        """Make room for ``num_new_tokens`` more tokens of ``request``; None if
        the pool cannot. Returns only the blocks allocated by this call.

        ``| computed | new_computed (prefix hits) | new | lookahead |``: the
        request holds blocks for ``computed``, the hits are cached blocks it
        will share, and ``new`` + ``lookahead`` need fresh blocks.
        """
        if num_new_tokens == 0:
            raise ValueError("num_new_tokens must be greater than 0")
        hit_blocks = new_computed_blocks.blocks[0] if new_computed_blocks else []
        num_req_blocks = len(self.req_to_blocks.get(request.request_id, ()))
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_need_slot = min(
            num_computed_tokens + num_new_tokens + num_lookahead_tokens, self.max_model_len
        )
        num_new_blocks = max(
            cdiv(num_tokens_need_slot, self.block_size) - num_req_blocks - len(hit_blocks), 0
        )
        # A hit on a free block takes it out of the free queue, so it costs a
        # free block just as a new one does.
        num_evictable_hits = sum(b.ref_cnt == 0 and not b.is_null for b in hit_blocks)
        if num_new_blocks + num_evictable_hits > self.block_pool.get_num_free_blocks():
            return None

        # Only now that it fits does the request get an entry (it counts in
        # get_num_common_prefix_blocks).
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        if hit_blocks:
            # Only a request not yet running has prefix hits (vLLM:
            # allocate_new_computed_blocks).
            assert not req_blocks, "prefix hits for a request that already holds blocks"
            self.block_pool.touch(hit_blocks)
            req_blocks.extend(hit_blocks)
            self.num_cached_block[request.request_id] = len(req_blocks)

        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)

        if self.enable_caching:
            # Cache the blocks these tokens will fill, now, before the forward
            # pass writes them. Capped at num_tokens: lookahead (draft) tokens
            # may be rejected, so their blocks are not final.
            self.cache_blocks(
                request, min(num_computed_tokens + num_new_tokens, request.num_tokens)
            )
        return KVCacheBlocks((new_blocks,))

    # --8<-- [end:allocate_slots]

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Enter the request's blocks that are full at ``num_computed_tokens``
        into the prefix cache (vLLM: SingleTypeKVCacheManager.cache_blocks)."""
        num_cached_blocks = self.num_cached_block.get(request.request_id, 0)
        num_full_blocks = num_computed_tokens // self.block_size
        if num_cached_blocks >= num_full_blocks:
            return
        self.block_pool.cache_full_blocks(
            request,
            self.req_to_blocks[request.request_id],
            num_cached_blocks,
            num_full_blocks,
            self.block_size,
        )
        self.num_cached_block[request.request_id] = num_full_blocks

    # --8<-- [start:free]
    def free(self, request: Request) -> None:
        """Free the request's blocks, tail first, so that its tail is evicted
        before the prefix it may share with other requests."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.block_pool.free_blocks(reversed(blocks))
        self.num_cached_block.pop(request.request_id, None)

    # --8<-- [end:free]

    def reset_prefix_cache(self) -> bool:
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Leading blocks of this request shared by every request holding KV
        (a hint for cascade attention), per KV cache group."""
        num_common_blocks = 0
        for block in self.req_to_blocks.get(running_request_id, []):
            if block.ref_cnt != len(self.req_to_blocks):
                break
            num_common_blocks += 1
        return [num_common_blocks]

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return KVCacheBlocks((list(self.req_to_blocks.get(request_id, [])),))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.get_blocks(request_id).get_block_ids()
