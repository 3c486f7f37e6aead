"""Lab 08 tests: get_new_blocks on a real BlockPool, then inside the real
KVCacheManager (free, evict, hit)."""

from __future__ import annotations

import types

import pytest
from _labkit import load

from tracevllm.core.block_pool import BlockPool
from tracevllm.core.kv_cache_manager import KVCacheManager
from tracevllm.core.kv_cache_utils import (
    BlockHash,
    get_request_block_hasher,
    make_block_hash_with_group_id,
    sha256,
)
from tracevllm.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from tracevllm.request import Request
from tracevllm.sampling_params import SamplingParams

get_new_blocks = load(__file__, "get_new_blocks")
BS = 4


def plug(pool: BlockPool) -> BlockPool:
    pool.get_new_blocks = types.MethodType(get_new_blocks, pool)  # type: ignore[method-assign]
    return pool


def make_pool(num_blocks: int = 8, caching: bool = True) -> BlockPool:
    return plug(BlockPool(num_blocks, enable_caching=caching, hash_block_size=BS))


def ids(blocks: list) -> list[int]:  # type: ignore[type-arg]
    return [b.block_id for b in blocks]


def cache(pool: BlockPool, block_id: int, name: str) -> BlockHash:
    """Give a block its key (hash + group 0) and enter it in the pool's map,
    as caching does. Returns the hash, which get_cached_block looks up."""
    block_hash = BlockHash(sha256(name))
    key = make_block_hash_with_group_id(block_hash, 0)
    block = pool.blocks[block_id]
    block.block_hash = key
    pool.cached_block_hash_to_block.insert(key, block)
    return block_hash


def cached(pool: BlockPool, block_hash: BlockHash) -> object:
    """The block a prefix lookup finds for this hash, or None."""
    found = pool.get_cached_block(block_hash, [0])
    return found[0] if found else None


def test_a_fresh_pool_hands_out_blocks_in_id_order() -> None:
    pool = make_pool()
    blocks = pool.get_new_blocks(3)
    assert ids(blocks) == [1, 2, 3]  # block 0 is the null block, never handed out
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.get_num_free_blocks() == 7 - 3
    assert ids(pool.get_new_blocks(2)) == [4, 5]


def test_the_least_recently_freed_block_goes_first() -> None:
    pool = make_pool()
    blocks = pool.get_new_blocks(7)
    by_id = {b.block_id: b for b in blocks}
    pool.free_blocks([by_id[3], by_id[1]])  # freed first: evicted first
    pool.free_blocks([by_id[6]])
    assert ids(pool.get_new_blocks(2)) == [3, 1]
    assert ids(pool.get_new_blocks(1)) == [6]


def test_asking_for_too_many_changes_nothing() -> None:
    pool = make_pool()
    pool.get_new_blocks(5)
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)
    assert pool.get_num_free_blocks() == 2
    assert ids(pool.get_new_blocks(2)) == [6, 7]


def test_a_reused_block_loses_its_hash() -> None:
    pool = make_pool()
    blocks = pool.get_new_blocks(3)
    h1, h2 = cache(pool, 1, "one"), cache(pool, 2, "two")
    pool.free_blocks(reversed(blocks))  # tail first: 3, 2, 1
    assert cached(pool, h1) is not None  # free, but still cached
    # The queue is now 4 5 6 7 3 2 1: the fresh blocks come first.
    assert ids(pool.get_new_blocks(5)) == [4, 5, 6, 7, 3]
    assert pool.num_cached_blocks == 2
    assert ids(pool.get_new_blocks(1)) == [2]  # reused: its old contents are gone
    assert cached(pool, h2) is None
    assert pool.blocks[2].block_hash is None
    assert pool.num_cached_blocks == 1
    assert cached(pool, h1) is pool.blocks[1]  # not reused yet: still a hit


def test_two_blocks_under_one_hash() -> None:
    """Two requests that computed the same block at once: one hash, two
    blocks. Evicting one leaves the other findable."""
    pool = make_pool()
    blocks = pool.get_new_blocks(2)
    same = cache(pool, 1, "same")
    cache(pool, 2, "same")
    pool.free_blocks(blocks)
    pool.get_new_blocks(5)  # the fresh blocks 3..7
    assert ids(pool.get_new_blocks(1)) == [1]
    assert cached(pool, same) is pool.blocks[2]
    assert pool.num_cached_blocks == 1  # block 1 left the map; block 2 is still in it
    pool.get_new_blocks(1)
    assert cached(pool, same) is None
    assert pool.num_cached_blocks == 0


def test_without_caching_there_is_nothing_to_evict() -> None:
    pool = make_pool(caching=False)
    blocks = pool.get_new_blocks(7)
    pool.free_blocks(blocks[::-1])
    assert ids(pool.get_new_blocks(3)) == [7, 6, 5]
    assert pool.num_cached_blocks == 0


# --- inside the KV cache manager ------------------------------------------------


def make_request(req_id: str, prompt: list[int]) -> Request:
    hasher = get_request_block_hasher(BS, sha256)
    return Request(req_id, prompt, SamplingParams(max_tokens=8), block_hasher=hasher)


def test_preemption_then_resume_as_the_book_records_it() -> None:
    """The KV cache chapter's run in miniature: a freed request's full blocks
    stay cached at the tail of the queue while another request takes the head;
    the freed request, coming back, hits them."""
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype="float32")
    config = KVCacheConfig(8, [], [KVCacheGroupSpec(["layer"], spec)])
    manager = KVCacheManager(config, max_model_len=64, hash_block_size=BS)
    plug(manager.block_pool)
    a = make_request("a", list(range(100, 110)))  # 10 tokens: blocks 1 2 3
    b = make_request("b", list(range(200, 210)))  # 10 tokens: blocks 4 5 6
    assert manager.allocate_slots(a, 10) is not None
    assert manager.allocate_slots(b, 10) is not None
    manager.free(b)  # preempted: 6 (partial, no hash), then 5, then 4 go to the tail
    queue = ids(manager.block_pool.free_block_queue.get_all_free_blocks())
    assert queue == [7, 6, 5, 4]
    # a runs 10 more tokens, 20 in all: 2 more blocks, 7 and 6 from the head.
    a.num_computed_tokens = 10
    a.append_output_token_ids(list(range(10)))
    new = manager.allocate_slots(a, 10)
    assert new is not None and new.get_block_ids() == ([7, 6],)
    # b's full blocks were not reused: coming back, it hits them.
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert num_hit_tokens == 8 and ids(hits.blocks[0]) == [4, 5]
