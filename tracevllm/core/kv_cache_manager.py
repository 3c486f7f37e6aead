"""The scheduler's view of the KV cache: which blocks each request holds.

Mirrors vllm/v1/core/kv_cache_manager.py (``KVCacheBlocks``,
``KVCacheManager``), with vLLM's constructor
(``KVCacheManager(kv_cache_config, max_model_len, hash_block_size, ...)``)
and layers: the manager asks a ``KVCacheCoordinator``
(kv_cache_coordinator.py), which asks one ``SingleTypeKVCacheManager`` per
KV cache group (single_type_kv_cache_manager.py); the requests' block tables
live there (``coordinator.single_type_managers[i].req_to_blocks``). A Llama
has one group. A KV connector's tokens (``num_external_computed_tokens``)
get fresh blocks after the local hit; an asynchronous load's blocks are
cached only once loaded (``delay_cache_blocks``; the scheduler calls
``cache_blocks`` then), and blocks that failed to load leave the prefix
cache (``evict_blocks``). vLLM's ``full_sequence_must_fit`` gate (an
argument of its ``allocate_slots``) is a method of its own here
(``full_sequence_fits``), so that ``allocate_slots`` keeps lab 02's
signature. Left out: encoder tokens, eagle, KV cache events and metrics,
context parallelism, and ``take_new_block_ids`` (blocks to zero, for
Mamba). Added, for views: ``get_num_cached_free_blocks`` and
``get_num_skipped_blocks_freed``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, overload

from tracevllm.core.kv_cache_coordinator import get_kv_cache_coordinator
from tracevllm.core.kv_cache_utils import KVCacheBlock
from tracevllm.labs import lab_hook
from tracevllm.metrics.stats import PrefixCacheStats

if TYPE_CHECKING:
    from collections.abc import Sequence

    from tracevllm.kv_cache_interface import KVCacheConfig
    from tracevllm.request import Request


@dataclass
class KVCacheBlocks:
    """What the KV manager hands the scheduler: blocks, one sequence per KV
    cache group (one group here), so the scheduler never sees its internals.
    An empty group is an empty tuple (the manager keeps one empty instance)."""

    blocks: tuple[Sequence[KVCacheBlock], ...]

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(
            tuple([*a, *b] for a, b in zip(self.blocks, other.blocks, strict=True))
        )

    @overload
    def get_block_ids(self, allow_none: Literal[False] = False) -> tuple[list[int], ...]: ...

    @overload
    def get_block_ids(self, allow_none: Literal[True]) -> tuple[list[int], ...] | None: ...

    def get_block_ids(self, allow_none: bool = False) -> tuple[list[int], ...] | None:
        """Block ids, one list per group; None for no block at all if ``allow_none``."""
        if allow_none and all(len(group) == 0 for group in self.blocks):
            return None
        return tuple([b.block_id for b in group] for group in self.blocks)

    def get_unhashed_block_ids(self) -> list[int]:
        """Ids of the blocks not (yet) in the prefix cache; one group only."""
        assert len(self.blocks) == 1, "Only one group is supported"
        return [b.block_id for b in self.blocks[0] if b.block_hash is None]

    def new_empty(self) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(() for _ in self.blocks))


class KVCacheManager:
    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        hash_block_size: int,
        max_num_batched_tokens: int | None = None,
        enable_caching: bool = True,
        log_stats: bool = False,
    ) -> None:
        self.max_model_len = max_model_len
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max_model_len
        self.enable_caching = enable_caching
        self.log_stats = log_stats
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.coordinator = get_kv_cache_coordinator(
            kv_cache_config=kv_cache_config,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_caching=enable_caching,
            hash_block_size=hash_block_size,
        )
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        self.block_pool = self.coordinator.block_pool
        self.kv_cache_config = kv_cache_config
        # One immutable empty result, handed out instead of building new ones.
        self.empty_kv_cache_blocks = KVCacheBlocks(
            tuple(() for _ in range(self.num_kv_cache_groups))
        )

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
        computed_blocks, num_new_computed_tokens = self.coordinator.find_longest_cache_hit(
            request.block_hashes, request.num_tokens - 1
        )
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.record(
                num_tokens=request.num_tokens,
                num_hits=num_new_computed_tokens,
                preempted=request.num_preemptions > 0,
            )
        return self.create_kv_cache_blocks(computed_blocks), num_new_computed_tokens

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
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> KVCacheBlocks | None:
        """Make room for ``num_new_tokens`` more tokens of ``request``; None if
        the pool cannot. Returns only the blocks allocated by this call.

        ``| computed | new_computed (prefix hits) | ext_computed | new | lookahead |``:
        the request holds blocks for ``computed``, the hits are cached blocks
        it will share, ``ext_computed`` are tokens a KV connector fills, and
        those, ``new`` and ``lookahead`` need fresh blocks. The blocks full at
        ``new`` are entered in the prefix cache now, unless
        ``delay_cache_blocks`` (an asynchronous load: its blocks hold nothing
        yet, and no other request may hit them before they do).
        """
        # An asynchronous load allocates for the connector's tokens alone.
        if num_new_tokens == 0 and num_external_computed_tokens == 0:
            raise ValueError(
                "num_new_tokens must be greater than 0 when there are no external computed tokens"
            )
        if new_computed_blocks is not None:
            new_computed_block_list = new_computed_blocks.blocks
        else:
            new_computed_block_list = self.empty_kv_cache_blocks.blocks
        num_local_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        total_computed_tokens = min(
            num_local_computed_tokens + num_external_computed_tokens, self.max_model_len
        )
        num_tokens_main_model = total_computed_tokens + num_new_tokens
        num_tokens_need_slot = min(num_tokens_main_model + num_lookahead_tokens, self.max_model_len)

        # Blocks outside the attention window go first, so fewer are evicted
        # (none for full attention).
        self.coordinator.remove_skipped_blocks(request.request_id, total_computed_tokens)
        # A hit on a free block takes it out of the free queue: the count
        # includes such hits. Nothing changes unless it all fits.
        num_blocks_to_allocate = self.coordinator.get_num_blocks_to_allocate(
            request_id=request.request_id,
            num_tokens=num_tokens_need_slot,
            new_computed_blocks=new_computed_block_list,
            num_encoder_tokens=0,
            total_computed_tokens=num_local_computed_tokens + num_external_computed_tokens,
            num_tokens_main_model=num_tokens_main_model,
        )
        if num_blocks_to_allocate > self.block_pool.get_num_free_blocks():
            return None

        # Hits first (touched, so handing out new blocks cannot evict them),
        # then the connector's blocks.
        if (
            new_computed_block_list is not self.empty_kv_cache_blocks.blocks
            or num_external_computed_tokens > 0
        ):
            self.coordinator.allocate_new_computed_blocks(
                request_id=request.request_id,
                new_computed_blocks=new_computed_block_list,
                num_local_computed_tokens=num_local_computed_tokens,
                num_external_computed_tokens=num_external_computed_tokens,
            )
        new_blocks = self.coordinator.allocate_new_blocks(
            request.request_id, num_tokens_need_slot, num_tokens_main_model
        )
        # An asynchronous load: cached once loaded (Scheduler._update_waiting_for_remote_kv).
        if self.enable_caching and not delay_cache_blocks:
            # Cache the blocks these tokens will fill, now, before the forward
            # pass writes them. Capped at num_tokens: lookahead (draft) tokens
            # may be rejected, so their blocks are not final.
            self.coordinator.cache_blocks(
                request, min(total_computed_tokens + num_new_tokens, request.num_tokens)
            )
        return self.create_kv_cache_blocks(new_blocks)

    # --8<-- [end:allocate_slots]

    def full_sequence_fits(
        self,
        request: Request,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_external_computed_tokens: int = 0,
    ) -> bool:
        """Whether the free blocks could hold the request's whole sequence,
        its prefix hits counted: vLLM's ``allocate_slots(...,
        full_sequence_must_fit=True)`` check, made before anything is
        allocated. vLLM gates every admission with it by default
        (``scheduler_reserve_full_isl``); the scheduler here gates only an
        asynchronous load with it (core/sched/scheduler.py)."""
        if new_computed_blocks is not None:
            new_computed_block_list = new_computed_blocks.blocks
        else:
            new_computed_block_list = self.empty_kv_cache_blocks.blocks
        total_computed_tokens = min(
            request.num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens,
            self.max_model_len,
        )
        full_num_tokens = min(request.num_tokens, self.max_model_len)
        num_blocks_to_allocate = self.coordinator.get_num_blocks_to_allocate(
            request_id=request.request_id,
            num_tokens=full_num_tokens,
            new_computed_blocks=new_computed_block_list,
            num_encoder_tokens=0,
            total_computed_tokens=total_computed_tokens,
            num_tokens_main_model=full_num_tokens,
        )
        return num_blocks_to_allocate <= self.block_pool.get_num_free_blocks()

    # --8<-- [start:free]
    def free(self, request: Request) -> None:
        """Free the request's blocks, tail first, so that its tail is evicted
        before the prefix it may share with other requests."""
        self.coordinator.free(request.request_id)

    # --8<-- [end:free]

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        """Free the blocks attention no longer reads (before a sliding window)."""
        self.coordinator.remove_skipped_blocks(request_id, total_computed_tokens)

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Take these blocks out of the prefix cache (they failed to load)."""
        self.block_pool.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Leading blocks of this request shared by every request holding KV
        (a hint for cascade attention), per KV cache group."""
        return self.coordinator.get_num_common_prefix_blocks(running_request_id)

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return self.create_kv_cache_blocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.get_blocks(request_id).get_block_ids()

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Enter the request's blocks full at ``num_computed_tokens`` into the prefix cache."""
        if self.enable_caching:
            self.coordinator.cache_blocks(request, num_computed_tokens)

    def create_kv_cache_blocks(self, blocks: tuple[list[KVCacheBlock], ...]) -> KVCacheBlocks:
        # The shared empty instance when there is nothing to return.
        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    # --- tracevllm's, for views ----------------------------------------------
    def get_num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a hash: evictable, but a prefix hit
        revives them. Counted from the blocks requests hold (a set: requests
        that share a prefix share its blocks), not by walking the free queue."""
        held_hashed = {
            block.block_id
            for manager in self.coordinator.single_type_managers
            for blocks in manager.req_to_blocks.values()
            for block in blocks
            if block.block_hash is not None
        }
        return max(self.block_pool.num_cached_blocks - len(held_hashed), 0)

    def get_num_skipped_blocks_freed(self) -> list[int]:
        """Per KV cache group, the blocks freed so far because they fell out
        of a sliding window (0 for full attention)."""
        return [m.num_skipped_blocks_freed for m in self.coordinator.single_type_managers]
