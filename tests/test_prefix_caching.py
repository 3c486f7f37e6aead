"""The prefix cache, driven with vLLM 0.22.0's signatures.

The ideas of vLLM's tests/v1/core/test_prefix_caching.py, written again for
tracevllm: ``KVCacheManager(kv_cache_config, max_model_len=, hash_block_size=)``,
``BlockPool(num_gpu_blocks, enable_caching, hash_block_size)``,
``cache_full_blocks(..., kv_cache_group_id=)``, ``BlockHashToBlockMap`` and
the group-id keys. Code written against vLLM's internals calls these as is.
"""

from __future__ import annotations

import pytest
import torch

from tracevllm.core.block_pool import BlockHashToBlockMap, BlockPool
from tracevllm.core.kv_cache_coordinator import HybridKVCacheCoordinator
from tracevllm.core.kv_cache_manager import KVCacheManager
from tracevllm.core.kv_cache_utils import (
    BlockHash,
    BlockHashWithGroupId,
    KVCacheBlock,
    get_block_hash,
    get_group_id,
    get_request_block_hasher,
    hash_block_tokens,
    init_none_hash,
    make_block_hash_with_group_id,
    sha256,
)
from tracevllm.core.single_type_kv_cache_manager import FullAttentionManager
from tracevllm.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from tracevllm.request import Request
from tracevllm.sampling_params import SamplingParams


@pytest.fixture(autouse=True)
def _none_hash() -> None:
    init_none_hash(sha256)


def make_request(request_id: str, prompt_token_ids: list[int], block_size: int) -> Request:
    sampling_params = SamplingParams(max_tokens=17)
    sampling_params.update_from_generation_config({}, 100)
    return Request(
        request_id,
        prompt_token_ids,
        sampling_params,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )


def make_kv_cache_config(block_size: int, num_blocks: int) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(
                    block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
                ),
            )
        ],
    )


def make_manager(num_blocks: int, block_size: int = 16, **kwargs: bool) -> KVCacheManager:
    return KVCacheManager(
        make_kv_cache_config(block_size, num_blocks),
        max_model_len=8192,
        hash_block_size=block_size,
        **kwargs,
    )


def free_ids(manager: KVCacheManager) -> list[int]:
    return [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]


def test_prefill() -> None:
    manager = make_manager(11)
    assert isinstance(manager.coordinator.single_type_managers[0], FullAttentionManager)
    common_token_ids = [i for i in range(3) for _ in range(16)]  # 3 full blocks

    # A full miss: 3 full blocks and 7 tokens.
    all_token_ids = common_token_ids + [3] * 7
    req0 = make_request("0", all_token_ids, 16)
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(req0)
    assert len(req0.block_hashes) == 3
    assert not computed_blocks.blocks[0] and num_computed_tokens == 0
    blocks = manager.allocate_slots(req0, 55, len(computed_blocks.blocks[0]) * 16, computed_blocks)
    assert blocks is not None and blocks.get_block_ids() == ([1, 2, 3, 4],)

    # The full blocks carry their hash, with group 0, chained on the block before.
    parent_block_hash = None
    for block_id in (1, 2, 3):
        block_tokens = tuple(all_token_ids[(block_id - 1) * 16 : block_id * 16])
        block_hash = hash_block_tokens(sha256, parent_block_hash, block_tokens)
        blk_hash = manager.block_pool.blocks[block_id].block_hash
        assert blk_hash is not None
        assert get_block_hash(blk_hash) == block_hash and get_group_id(blk_hash) == 0
        assert manager.block_pool.blocks[block_id].ref_cnt == 1
        parent_block_hash = block_hash
    assert manager.block_pool.blocks[4].block_hash is None  # partial
    assert manager.block_pool.blocks[4].ref_cnt == 1

    # A hit on the common prefix while its blocks are held.
    req1 = make_request("1", common_token_ids + [3] * 5, 16)
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(req1)
    assert computed_blocks.get_block_ids() == ([1, 2, 3],) and num_computed_tokens == 48
    blocks = manager.allocate_slots(req1, 53 - 48, 48, computed_blocks)
    assert blocks is not None and blocks.get_block_ids() == ([5],)
    assert all(block.ref_cnt == 2 for block in computed_blocks.blocks[0])
    assert manager.block_pool.free_block_queue.num_free_blocks == 5

    manager.free(req0)
    manager.free(req1)
    assert manager.block_pool.free_block_queue.num_free_blocks == 10
    # Never used (6..10), then each request's blocks tail first: req0's
    # partial 4; then req1's partial 5 and the common 3, 2, 1, freed last.
    assert free_ids(manager) == [6, 7, 8, 9, 10, 4, 5, 3, 2, 1]

    # A hit on the common prefix once its blocks are free.
    req2 = make_request("2", common_token_ids + [3] * 6, 16)
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(req2)
    assert computed_blocks.get_block_ids() == ([1, 2, 3],) and num_computed_tokens == 48
    blocks = manager.allocate_slots(req2, 54 - 48, 48, computed_blocks)
    assert blocks is not None and blocks.get_block_ids() == ([6],)
    assert manager.block_pool.free_block_queue.num_free_blocks == 6
    assert all(b.ref_cnt == 0 for b in manager.block_pool.free_block_queue.get_all_free_blocks())
    manager.free(req2)

    # A miss that evicts: the blocks come in eviction order.
    req3 = make_request("3", [99] * (16 * 10), 16)
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(req3)
    assert not computed_blocks.blocks[0] and num_computed_tokens == 0
    blocks = manager.allocate_slots(req3, 16 * 10, 0, computed_blocks)
    assert blocks is not None
    assert blocks.get_block_ids() == ([7, 8, 9, 10, 4, 5, 6, 3, 2, 1],)
    queue = manager.block_pool.free_block_queue
    assert queue.num_free_blocks == 0
    assert queue.fake_free_list_head.next_free_block is queue.fake_free_list_tail
    assert queue.fake_free_list_tail.prev_free_block is queue.fake_free_list_head


def test_decode() -> None:
    manager = make_manager(11)
    common_token_ids = [i for i in range(3) for _ in range(16)]
    req0 = make_request("0", common_token_ids + [3] * 7, 16)
    computed_blocks, _ = manager.get_computed_blocks(req0)
    blocks = manager.allocate_slots(req0, 55, 0, computed_blocks)
    assert blocks is not None and blocks.get_block_ids() == ([1, 2, 3, 4],)

    # Decode: the partial block fills (tokens 56..64), then the 65th takes block 5.
    req0.num_computed_tokens = 55
    for token in range(9):
        req0.append_output_token_ids(8 + token)
        new_blocks = manager.allocate_slots(req0, 1)
        assert new_blocks is not None and new_blocks.get_block_ids() == ([],)
        req0.num_computed_tokens += 1
    # The 4th block was cached by the allocation that filled it.
    assert len(req0.block_hashes) == 4
    assert get_block_hash(manager.block_pool.blocks[4].block_hash) == req0.block_hashes[3]  # type: ignore[arg-type]
    req0.append_output_token_ids(100)
    new_blocks = manager.allocate_slots(req0, 1)
    assert new_blocks is not None and new_blocks.get_block_ids() == ([5],)
    assert manager.get_block_ids("0") == ([1, 2, 3, 4, 5],)


def test_evict() -> None:
    manager = make_manager(11)
    last_token_id = 5 * 16 + 7
    req0 = make_request("0", list(range(last_token_id)), 16)
    blocks = manager.allocate_slots(req0, 5 * 16 + 7)
    assert blocks is not None and len(blocks.blocks[0]) == 6  # 5 full + 1 partial

    req1 = make_request("1", list(range(last_token_id, last_token_id + 3 * 16)), 16)
    blocks = manager.allocate_slots(req1, 3 * 16)
    assert blocks is not None and len(blocks.blocks[0]) == 3  # 3 full blocks
    assert manager.block_pool.free_block_queue.num_free_blocks == 1

    manager.free(req0)
    manager.free(req1)
    assert manager.block_pool.free_block_queue.num_free_blocks == 10
    assert free_ids(manager) == [10, 6, 5, 4, 3, 2, 1, 9, 8, 7]

    # A hit on the first 2 blocks takes them out of the queue; the new block is its head.
    req2 = make_request("2", list(range(2 * 16 + 3)), 16)
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(req2)
    assert computed_blocks.get_block_ids() == ([1, 2],) and num_computed_tokens == 2 * 16
    blocks = manager.allocate_slots(req2, 3, num_computed_tokens, computed_blocks)
    assert blocks is not None and blocks.get_block_ids() == ([10],)
    assert manager.block_pool.free_block_queue.num_free_blocks == 7


def test_hash_block_correct_reuse() -> None:
    """A cached block, evicted and handed to another request, loses its hash."""
    manager = make_manager(2)  # one usable block
    req = make_request("0", list(range(16)), 16)
    blocks = manager.allocate_slots(req, 16)
    assert blocks is not None and len(blocks.blocks[0]) == 1
    assert manager.block_pool.blocks[1].block_hash is not None
    manager.free(req)

    req = make_request("1", list(range(15)), 16)
    blocks = manager.allocate_slots(req, 15)
    assert blocks is not None and len(blocks.blocks[0]) == 1
    assert manager.block_pool.blocks[blocks.blocks[0][0].block_id].block_hash is None


def test_computed_blocks_not_evicted() -> None:
    """Allocating a request's new blocks never evicts its own prefix hits."""
    manager = make_manager(3)  # two usable blocks
    req0 = make_request("0", list(range(16)), 16)
    blocks = manager.allocate_slots(req0, 16)
    assert blocks is not None and blocks.blocks[0][0].block_id == 1
    req1 = make_request("1", list(range(16, 32)), 16)
    blocks = manager.allocate_slots(req1, 16)
    assert blocks is not None and blocks.blocks[0][0].block_id == 2
    manager.free(req0)
    manager.free(req1)  # the queue is [1, 2]: block 1 would be evicted first

    req2 = make_request("2", list(range(16 * 2)), 16)
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(req2)
    assert computed_blocks.get_block_ids() == ([1],) and num_computed_tokens == 16
    blocks = manager.allocate_slots(req2, 16, 16, computed_blocks)
    assert blocks is not None and blocks.get_block_ids() == ([2],)
    assert manager.get_block_ids("2") == ([1, 2],)


def test_basic_prefix_caching_disabled() -> None:
    manager = make_manager(5, block_size=4, enable_caching=False)
    req1 = make_request("1", list(range(10)), 4)  # 2 full blocks + 2 tokens
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(req1)
    assert not computed_blocks.blocks[0] and num_computed_tokens == 0
    blocks = manager.allocate_slots(req1, 10)
    assert blocks is not None and len(blocks.blocks[0]) == 3
    manager.free(req1)

    # No caching: the same prompt misses.
    req2 = make_request("2", list(range(16)), 4)
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(req2)
    assert not computed_blocks.blocks[0] and num_computed_tokens == 0
    blocks = manager.allocate_slots(req2, 16)
    assert blocks is not None and len(blocks.blocks[0]) == 4

    # New requests cannot have blocks: the pool is empty.
    req3 = make_request("3", [99] * 4, 4)
    assert manager.allocate_slots(req3, 4) is None


def test_cache_blocks() -> None:
    """cache_full_blocks with vLLM's signature: blocks get (hash, group) keys."""
    block_size = 4
    block_pool = BlockPool(num_gpu_blocks=5, enable_caching=True, hash_block_size=block_size)
    req = make_request("0", list(range(14)), block_size)  # 3 full blocks
    blocks = [KVCacheBlock(block_id=i) for i in range(2)]
    block_pool.cache_full_blocks(
        request=req,
        blocks=blocks,
        num_cached_blocks=0,
        num_full_blocks=2,
        block_size=block_size,
        kv_cache_group_id=0,
    )
    assert len(block_pool.cached_block_hash_to_block) == 2
    assert all(block.block_hash is not None for block in blocks)

    # Blocks that do not start at the first are cached too, under their own hash.
    blocks += [KVCacheBlock(block_id=2)]
    block_pool.cache_full_blocks(
        request=req,
        blocks=blocks,
        num_cached_blocks=2,
        num_full_blocks=3,
        block_size=block_size,
        kv_cache_group_id=0,
    )
    assert len(block_pool.cached_block_hash_to_block) == 3
    assert [get_block_hash(b.block_hash) for b in blocks] == req.block_hashes  # type: ignore[arg-type]
    assert block_pool.get_cached_block(req.block_hashes[2], [0]) == [blocks[2]]
    # Another group's key for the same tokens is another entry.
    assert block_pool.get_cached_block(req.block_hashes[2], [1]) is None
    assert block_pool.get_cached_block(req.block_hashes[2], [0, 1]) is None


def test_cache_blocks_skips_masked_and_null_blocks() -> None:
    block_size = 4
    block_pool = BlockPool(num_gpu_blocks=5, enable_caching=True, hash_block_size=block_size)
    req = make_request("0", list(range(12)), block_size)
    blocks = [block_pool.null_block, KVCacheBlock(1), KVCacheBlock(2)]
    block_pool.cache_full_blocks(
        request=req,
        blocks=blocks,
        num_cached_blocks=0,
        num_full_blocks=3,
        block_size=block_size,
        kv_cache_group_id=0,
        block_mask=[True, False, True],
    )
    assert [b.block_hash is not None for b in blocks] == [False, False, True]
    assert block_pool.num_cached_blocks == 1


def test_group_id_keys() -> None:
    block_hash = BlockHash(b"abc")
    key = make_block_hash_with_group_id(block_hash, 3)
    assert key == b"abc\x00\x00\x00\x03"
    assert get_block_hash(key) == block_hash and get_group_id(key) == 3
    assert make_block_hash_with_group_id(block_hash, 0) != make_block_hash_with_group_id(
        block_hash, 1
    )


def test_reset_prefix_cache() -> None:
    manager = make_manager(11)
    full_block_token_ids = [i for i in range(3) for _ in range(16)]
    req0 = make_request("0", full_block_token_ids + [3] * 7, 16)
    blocks = manager.allocate_slots(req0, 55)
    assert blocks is not None and blocks.get_block_ids() == ([1, 2, 3, 4],)

    req1 = make_request("1", full_block_token_ids + [4] * 7, 16)
    computed_blocks, _ = manager.get_computed_blocks(req1)
    assert len(req1.block_hashes) == 3 and len(computed_blocks.blocks[0]) == 3
    blocks = manager.allocate_slots(req1, 7, 3 * 16, computed_blocks)
    assert blocks is not None and blocks.get_block_ids() == ([5],)

    # Not while blocks are held.
    assert not manager.reset_prefix_cache()
    assert manager.block_pool.cached_block_hash_to_block

    manager.free(req0)
    manager.free(req1)
    assert manager.reset_prefix_cache()
    assert not manager.block_pool.cached_block_hash_to_block
    assert all(blk.block_hash is None for blk in manager.block_pool.blocks)


def test_prefix_cache_stats_disabled() -> None:
    manager = make_manager(11, log_stats=False)
    assert manager.prefix_cache_stats is None
    req = make_request("0", list(range(16)), 16)
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(req)
    assert not computed_blocks.blocks[0] and num_computed_tokens == 0
    manager.allocate_slots(req, 16, 0, computed_blocks)
    manager.reset_prefix_cache()
    assert manager.prefix_cache_stats is None


def test_maybe_evict_cached_block() -> None:
    pool = BlockPool(num_gpu_blocks=4, enable_caching=True, hash_block_size=16)
    block_hash0 = make_block_hash_with_group_id(BlockHash(b"10"), 1000)
    block_hash1 = make_block_hash_with_group_id(BlockHash(b"20"), 2000)
    block_hash2 = make_block_hash_with_group_id(BlockHash(b"30"), 3000)
    # block 3 has the same hash as block 0
    block_hashes = [block_hash0, block_hash1, block_hash2, block_hash0]
    for block, block_hash in zip(pool.blocks, block_hashes, strict=True):
        block.block_hash = block_hash
        pool.cached_block_hash_to_block.insert(block_hash, block)
    block0, block1, block2, block3 = pool.blocks
    assert pool.cached_block_hash_to_block._cache == {
        block_hash0: {block0.block_id: block0, block3.block_id: block3},
        block_hash1: block1,
        block_hash2: block2,
    }
    # A block that was never cached: nothing happens.
    assert not pool._maybe_evict_cached_block(KVCacheBlock(block_id=5))
    pool._maybe_evict_cached_block(block1)
    assert pool.cached_block_hash_to_block._cache == {
        block_hash0: {block0.block_id: block0, block3.block_id: block3},
        block_hash2: block2,
    }
    pool._maybe_evict_cached_block(block0)
    assert pool.cached_block_hash_to_block._cache == {
        block_hash0: {block3.block_id: block3},
        block_hash2: block2,
    }
    pool._maybe_evict_cached_block(block2)
    assert pool.cached_block_hash_to_block._cache == {block_hash0: {3: block3}}
    pool._maybe_evict_cached_block(block3)
    assert pool.cached_block_hash_to_block._cache == {}
    assert pool.num_cached_blocks == 0


def test_block_lookup_cache_single_block_per_key() -> None:
    cache = BlockHashToBlockMap()
    key0, key1, key2 = (BlockHashWithGroupId(b"hash" + bytes([i])) for i in range(3))
    block0, block1 = KVCacheBlock(0), KVCacheBlock(1)
    assert cache.get_one_block(key0) is None
    assert cache.pop(key0, 0) is None
    cache.insert(key0, block0)
    cache.insert(key1, block1)
    assert len(cache) == 2
    assert cache.get_one_block(key0) is block0 and cache.get_one_block(key1) is block1
    assert cache.get_one_block(key2) is None
    assert cache.pop(key0, 1) is None  # another block id: it stays
    assert cache.get_one_block(key0) is block0
    assert cache.pop(key0, 0) is block0
    assert cache.get_one_block(key0) is None and len(cache) == 1
    assert cache.num_blocks == 1


def test_block_lookup_cache_multi_blocks_per_key() -> None:
    cache = BlockHashToBlockMap()
    key0, key1 = BlockHashWithGroupId(b"hash0"), BlockHashWithGroupId(b"hash1")
    block00, block01, block10, block11 = (KVCacheBlock(i) for i in (0, 1, 10, 11))
    for k, b in ((key0, block00), (key0, block01), (key1, block10), (key1, block11)):
        cache.insert(k, b)
    assert len(cache) == 2 and cache.num_blocks == 4
    assert cache.get_one_block(key0) is block00 and cache.get_one_block(key1) is block10
    assert cache.pop(key0, 1) is block01
    assert cache.get_one_block(key0) is block00
    assert cache.pop(key0, 0) is block00
    assert cache.get_one_block(key0) is None
    assert cache.pop(key1, 10) is block10
    assert cache.get_one_block(key1) is block11
    assert cache.num_blocks == 1


def test_allocate_with_lookahead() -> None:
    block_size = 4
    config = make_kv_cache_config(block_size, 10)
    request = make_request("0", [1, 2, 3], block_size)
    # 3 new tokens + 2 lookahead slots: ceil(5 / 4) = 2 blocks.
    manager = KVCacheManager(config, max_model_len=100, hash_block_size=block_size)
    blocks = manager.allocate_slots(request, num_new_tokens=3, num_lookahead_tokens=2)
    assert blocks is not None and len(blocks.get_block_ids()[0]) == 2
    # 3 + 4 lookahead: ceil(7 / 4) = 2 blocks.
    manager = KVCacheManager(config, max_model_len=100, hash_block_size=block_size)
    blocks = manager.allocate_slots(request, num_new_tokens=3, num_lookahead_tokens=4)
    assert blocks is not None and len(blocks.get_block_ids()[0]) == 2
    # Lookahead slots are capped at max_model_len: 3 + 8 > 8.
    manager = KVCacheManager(config, max_model_len=8, hash_block_size=block_size)
    blocks = manager.allocate_slots(request, num_new_tokens=3, num_lookahead_tokens=8)
    assert blocks is not None and len(blocks.get_block_ids()[0]) == 2


def test_prefill_not_enough_free_blocks_with_computed_blocks() -> None:
    """A request whose hits are free blocks needs free blocks for them too;
    when it cannot fit, nothing changes."""
    manager = make_manager(11)
    common_token_ids = [i for i in range(3) for _ in range(16)]
    req0 = make_request("0", common_token_ids, 16)
    manager.allocate_slots(req0, 48)
    manager.free(req0)  # 3 cached blocks, free

    req1 = make_request("1", [99] * 16 * 7, 16)
    assert manager.allocate_slots(req1, 16 * 7) is not None  # 7 of the 10 free blocks
    assert manager.block_pool.free_block_queue.num_free_blocks == 3
    assert free_ids(manager) == [3, 2, 1]  # the cached ones, tail first

    # 2 hits (free) + 2 new blocks > 3 free blocks.
    req2 = make_request("2", common_token_ids[:32] + [5] * 20, 16)
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(req2)
    assert computed_blocks.get_block_ids() == ([1, 2],)
    assert manager.allocate_slots(req2, 20, num_computed_tokens, computed_blocks) is None
    assert [manager.block_pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [0, 0, 0]
    assert free_ids(manager) == [3, 2, 1]
    assert "2" not in manager.coordinator.single_type_managers[0].req_to_blocks


# --- sliding window and hybrid groups ---------------------------------------


def make_hybrid_manager(num_blocks: int, window: int = 8, block_size: int = 4) -> KVCacheManager:
    """Two KV cache groups, as Gemma-2's alternating layers: full, sliding."""
    spec = dict(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["full.0"], FullAttentionSpec(**spec)),  # type: ignore[arg-type]
            KVCacheGroupSpec(["sw.0"], SlidingWindowSpec(**spec, sliding_window=window)),  # type: ignore[arg-type]
        ],
    )
    return KVCacheManager(config, max_model_len=8192, hash_block_size=block_size)


def test_hybrid_prefix_hit_is_the_length_both_groups_agree_on() -> None:
    """Full attention needs every block of the hit, the sliding window only the
    last cdiv(W - 1, block_size) = 2: the hit is the longest length both take."""
    mgr = make_hybrid_manager(60)
    assert isinstance(mgr.coordinator, HybridKVCacheCoordinator)
    assert mgr.coordinator.lcm_block_size == 4
    prompt = list(range(29))  # 7 full blocks and one token
    a = make_request("a", prompt, 4)
    assert mgr.allocate_slots(a, 29) is not None  # 8 blocks in each group
    assert mgr.block_pool.get_num_free_blocks() == 59 - 16
    a_full, a_sw = mgr.get_block_ids("a")
    a.num_computed_tokens = 29
    mgr.free(a)  # every full block stays cached, in both groups

    # All cached: 28 tokens (one short of the prompt), the window's from block 5 on.
    hit, n = mgr.get_computed_blocks(make_request("b", prompt, 4))
    assert n == 28
    assert hit.get_block_ids() == (a_full[:7], [0] * 5 + a_sw[5:7])

    # The sliding group's blocks 5 and 6 evicted: its longest hit ends at block 4
    # (a run of 3 and 4), and full attention is cut back to it.
    for block_id in a_sw[5:7]:
        assert mgr.block_pool._maybe_evict_cached_block(mgr.block_pool.blocks[block_id])
    hit, n = mgr.get_computed_blocks(make_request("c", prompt, 4))
    assert n == 20
    assert hit.get_block_ids() == (a_full[:5], [0] * 3 + a_sw[3:5])

    # Full attention's block 1 evicted: one block; the window's run of one
    # leading block is a hit too (it reaches token 0).
    assert mgr.block_pool._maybe_evict_cached_block(mgr.block_pool.blocks[a_full[1]])
    hit, n = mgr.get_computed_blocks(make_request("d", prompt, 4))
    assert n == 4
    assert hit.get_block_ids() == (a_full[:1], a_sw[:1])


def test_hybrid_allocation_with_a_hit_and_a_long_decode() -> None:
    """The hit's blocks before the window stay null in the sliding group; as
    the request decodes, the sliding group gives blocks back and the full one
    keeps them all."""
    mgr = make_hybrid_manager(60)
    prompt = list(range(29))
    a = make_request("a", prompt, 4)
    mgr.allocate_slots(a, 29)
    a_full, a_sw = mgr.get_block_ids("a")
    a.num_computed_tokens = 29
    mgr.free(a)

    b = make_request("b", prompt + [7, 7, 7], 4)  # 32 tokens
    hit, n = mgr.get_computed_blocks(b)
    assert n == 28
    free_before = mgr.block_pool.get_num_free_blocks()
    new = mgr.allocate_slots(b, 4, n, hit)
    assert new is not None
    full_ids, sw_ids = mgr.get_block_ids("b")
    assert full_ids[:7] == a_full[:7] and len(full_ids) == 8
    # 28 computed: tokens 0 .. 20 before the window -> 5 null blocks.
    assert sw_ids[:7] == [0] * 5 + a_sw[5:7] and len(sw_ids) == 8
    # 7 + 2 revived hits and a new block per group.
    assert mgr.block_pool.get_num_free_blocks() == free_before - 9 - 2
    b.num_computed_tokens = 32
    for _ in range(40):  # decode: the sliding group stays within its window
        b.append_output_token_ids(7)
        assert mgr.allocate_slots(b, 1) is not None
        b.num_computed_tokens += 1
        full_ids, sw_ids = mgr.get_block_ids("b")
        assert len([i for i in sw_ids if i != 0]) <= -(-8 // 4) + 1
        assert 0 not in full_ids and len(full_ids) == -(-b.num_computed_tokens // 4)
    mgr.free(b)
    assert mgr.block_pool.get_num_free_blocks() == 59
