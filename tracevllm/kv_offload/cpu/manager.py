"""``CPUOffloadingManager``: which blocks the CPU tier holds, in which of its slots, by LRU.

Mirrors vllm/v1/kv_offload/cpu/manager.py, with its LRU policy
(vllm/v1/kv_offload/cpu/policies/lru.py, ``LRUCachePolicy`` over one
``OrderedDict``), ``BlockStatus`` (cpu/policies/base.py) and
``CPULoadStoreSpec`` (cpu/common.py) folded in. The tier has ``num_blocks``
slots, never more: ``prepare_store`` takes free slots first, then evicts the
least recently used blocks that no load is reading (``ref_cnt`` 0) and that
are not among the blocks being stored; if that is not enough it stores
nothing (None). A block is readable once its store completes (``ref_cnt``
-1 until then: ``lookup`` answers None, "in flight").

tracevllm adds counters (``stats``): blocks stored, evicted, loaded and
discarded, and lookups that hit, for the engine's stats and the tests; and
``discard``: a block a load failed to read leaves the tier (once no other
load holds it; until then ``lookup`` misses it). Left out: vLLM's ARC
policy and the ``store_threshold`` filter (a block stored only after it was
looked up that many times).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from tracevllm.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
)


class CPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """Blocks (slots) of the CPU tier's region."""

    @staticmethod
    def medium() -> str:
        return "CPU"


class BlockStatus:
    """One slot's state: ``ref_cnt`` loads reading it (-1: not written yet)."""

    __slots__ = ("block_id", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.ref_cnt = -1
        self.block_id = block_id

    @property
    def is_ready(self) -> bool:
        return self.ref_cnt >= 0


class LRUCachePolicy:
    """vLLM's LRU: the blocks in one OrderedDict, least recently used first."""

    def __init__(self, cache_capacity: int) -> None:
        # cache_capacity unused by LRU (vLLM's uniform constructor).
        self.blocks: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()

    def get(self, key: OffloadKey) -> BlockStatus | None:
        return self.blocks.get(key)

    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        self.blocks[key] = block

    def remove(self, key: OffloadKey) -> None:
        del self.blocks[key]

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        # Reversed: a request's first block ends most recently used, so that
        # its tail goes first (a prefix is only useful from its start).
        for key in reversed(list(keys)):
            if key in self.blocks:
                self.blocks.move_to_end(key)

    def clear(self) -> None:
        self.blocks.clear()

    def evict(
        self, n: int, protected: set[OffloadKey]
    ) -> list[tuple[OffloadKey, BlockStatus]] | None:
        """Exactly n unreferenced, unprotected blocks, oldest first; None (and
        nothing changed) if there are fewer."""
        if n == 0:
            return []
        candidates: list[tuple[OffloadKey, BlockStatus]] = []
        for key, block in self.blocks.items():
            if block.ref_cnt == 0 and key not in protected:
                candidates.append((key, block))
                if len(candidates) == n:
                    break
        if len(candidates) < n:
            return None
        for key, _ in candidates:
            del self.blocks[key]
        return candidates


_CACHE_POLICIES = {"lru": LRUCachePolicy}


@dataclass
class CPUOffloadingStats:
    """tracevllm's counters of the tier, since the engine started (blocks)."""

    stored: int = 0
    evicted: int = 0
    loaded: int = 0
    # Dropped after a load from them failed (discard).
    discarded: int = 0
    # lookup() calls answered True / made.
    lookup_hits: int = 0
    lookups: int = 0


class CPUOffloadingManager(OffloadingManager):
    def __init__(
        self, num_blocks: int, cache_policy: str = "lru", enable_events: bool = False
    ) -> None:
        self.medium: str = CPULoadStoreSpec.medium()
        self._num_blocks = num_blocks
        self._num_allocated_blocks = 0
        self._free_list: list[int] = []
        self.events: list[OffloadingEvent] | None = [] if enable_events else None
        policy_cls = _CACHE_POLICIES.get(cache_policy)
        if policy_cls is None:
            raise ValueError(
                f"Unknown cache policy: {cache_policy!r}. Supported: {list(_CACHE_POLICIES)}"
            )
        self._policy = policy_cls(cache_capacity=num_blocks)
        # Discarded while a load held them: they go when it completes.
        self._to_discard: set[OffloadKey] = set()
        self.stats = CPUOffloadingStats()

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    def get_num_stored_blocks(self) -> int:
        """Blocks the tier holds now (written or being written)."""
        return len(self._policy.blocks)

    # ------------------------------------------------------------- slot pool
    def _get_num_free_blocks(self) -> int:
        return len(self._free_list) + self._num_blocks - self._num_allocated_blocks

    def _allocate_blocks(self, keys: list[OffloadKey]) -> list[BlockStatus]:
        num_fresh = min(len(keys), self._num_blocks - self._num_allocated_blocks)
        num_reused = len(keys) - num_fresh
        assert len(self._free_list) >= num_reused
        blocks: list[BlockStatus] = []
        for _ in range(num_fresh):
            blocks.append(BlockStatus(self._num_allocated_blocks))
            self._num_allocated_blocks += 1
        for _ in range(num_reused):
            blocks.append(BlockStatus(self._free_list.pop()))
        return blocks

    def _free_block(self, block: BlockStatus) -> None:
        self._free_list.append(block.block_id)

    # ------------------------------------------------- OffloadingManager API
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        self.stats.lookups += 1
        block = self._policy.get(key)
        if block is None or key in self._to_discard:
            return False
        if not block.is_ready:
            return None  # its write is in flight: ask again
        self.stats.lookup_hits += 1
        return True

    def prepare_load(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> CPULoadStoreSpec:
        blocks = []
        for key in keys:
            block = self._policy.get(key)
            assert block is not None, f"Block {key!r} not found in cache"
            assert block.is_ready, f"Block {key!r} is not ready for reading"
            block.ref_cnt += 1
            blocks.append(block)
        self.stats.loaded += len(blocks)
        return CPULoadStoreSpec([block.block_id for block in blocks])

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._policy.touch(keys)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        for key in keys:
            block = self._policy.get(key)
            assert block is not None, f"Block {key!r} not found"
            assert block.ref_cnt > 0, f"Block {key!r} ref_cnt is already 0"
            block.ref_cnt -= 1
        if self._to_discard:
            self.discard([k for k in keys if k in self._to_discard], req_context)

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        # Only the blocks the tier lacks.
        keys_to_store = [k for k in keys if self._policy.get(k) is None]
        if not keys_to_store:
            return PrepareStoreOutput(
                keys_to_store=[], store_spec=CPULoadStoreSpec([]), evicted_keys=[]
            )
        num_blocks_to_evict = len(keys_to_store) - self._get_num_free_blocks()
        to_evict: list[OffloadKey] = []
        if num_blocks_to_evict > 0:
            # A block of this very store that is already held must stay.
            evicted = self._policy.evict(num_blocks_to_evict, set(keys))
            if evicted is None:
                return None
            for key, block in evicted:
                self._free_block(block)
                to_evict.append(key)
            self.stats.evicted += len(to_evict)
            if self.events is not None:
                self.events.append(OffloadingEvent(keys=to_evict, medium=self.medium, removed=True))
        blocks = self._allocate_blocks(keys_to_store)
        assert len(blocks) == len(keys_to_store)
        for key, block in zip(keys_to_store, blocks, strict=True):
            self._policy.insert(key, block)
        return PrepareStoreOutput(
            keys_to_store=keys_to_store,
            store_spec=CPULoadStoreSpec([block.block_id for block in blocks]),
            evicted_keys=to_evict,
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        stored_keys: list[OffloadKey] = []
        for key in keys:
            block = self._policy.get(key)
            if block is None or block.is_ready:
                continue
            if success:
                block.ref_cnt = 0
                stored_keys.append(key)
            else:
                self._policy.remove(key)
                self._free_block(block)
        self.stats.stored += len(stored_keys)
        if stored_keys and self.events is not None:
            self.events.append(OffloadingEvent(keys=stored_keys, medium=self.medium, removed=False))

    def discard(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        discarded: list[OffloadKey] = []
        for key in keys:
            block = self._policy.get(key)
            # Gone already, or evicted and being written again since.
            if block is None or not block.is_ready:
                self._to_discard.discard(key)
                continue
            if block.ref_cnt > 0:
                self._to_discard.add(key)  # another load reads it: when it is done
                continue
            self._to_discard.discard(key)
            self._policy.remove(key)
            self._free_block(block)
            discarded.append(key)
        self.stats.discarded += len(discarded)
        if discarded and self.events is not None:
            self.events.append(OffloadingEvent(keys=discarded, medium=self.medium, removed=True))

    def reset_cache(self) -> None:
        self._to_discard.clear()
        self._policy.clear()
        self._free_list.clear()
        self._num_allocated_blocks = 0

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self.events is not None:
            yield from self.events
            self.events.clear()
