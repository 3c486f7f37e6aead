"""KV cache bookkeeping: free queue, block hashes, block pool, KV cache manager,
and the public accessors the step view reads."""

from __future__ import annotations

import ast
import inspect
import json

import pytest
from opentelemetry.sdk.trace import TracerProvider

from tracevllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from tracevllm.core.block_pool import BlockPool
from tracevllm.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from tracevllm.core.kv_cache_utils import (
    NONE_HASH,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    get_hash_fn_by_name,
    get_request_block_hasher,
    hash_block_tokens,
    make_block_hash_with_group_id,
    sha256,
)
from tracevllm.core.sched.scheduler import Scheduler
from tracevllm.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from tracevllm.request import Request, RequestStatus
from tracevllm.sampling_params import SamplingParams
from tracevllm.tracing import step_view
from tracevllm.tracing.attributes import SpanAttributes

BS = 4  # block size


def make_request(req_id: str, prompt: list[int], block_size: int = BS) -> Request:
    params = SamplingParams(max_tokens=16, temperature=0)
    params.update_from_generation_config({}, 2)
    return Request(
        req_id, prompt, params, block_hasher=get_request_block_hasher(block_size, sha256)
    )


def make_manager(num_blocks: int, max_model_len: int = 64, **kwargs: bool) -> KVCacheManager:
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype="float32")
    config = KVCacheConfig(num_blocks, [], [KVCacheGroupSpec(["layer"], spec)])
    return KVCacheManager(config, max_model_len=max_model_len, hash_block_size=BS, **kwargs)


def req_to_blocks(mgr: KVCacheManager) -> dict[str, list[KVCacheBlock]]:
    return mgr.coordinator.single_type_managers[0].req_to_blocks


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def key(block_hash: bytes) -> bytes:
    """The prefix cache's key of a block hash in tracevllm's one group."""
    return make_block_hash_with_group_id(block_hash, 0)  # type: ignore[arg-type]


def check_pool(pool: BlockPool) -> None:
    """Free + held blocks = every usable block; the free queue holds exactly
    the ref-0 blocks; the hash map, its count and the blocks' hashes agree."""
    free = pool.free_block_queue.get_all_free_blocks()
    assert len(free) == pool.get_num_free_blocks()
    held = [b for b in pool.blocks if b.ref_cnt > 0 and not b.is_null]
    assert len(free) + len(held) == pool.num_gpu_blocks - 1
    assert {b.block_id for b in free} == {
        b.block_id for b in pool.blocks if b.ref_cnt == 0 and not b.is_null
    }
    cached = [
        b
        for v in pool.cached_block_hash_to_block._cache.values()
        for b in ([v] if isinstance(v, KVCacheBlock) else v.values())
    ]
    assert len(cached) == pool.num_cached_blocks
    assert all(b.block_hash is not None for b in cached)
    assert sum(b.block_hash is not None for b in pool.blocks) == pool.num_cached_blocks


# --- FreeKVCacheBlockQueue ---------------------------------------------------


def test_free_queue_ops() -> None:
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.num_free_blocks == 6
    assert ids(q.get_all_free_blocks()) == [0, 1, 2, 3, 4, 5]

    assert q.popleft().block_id == 0
    q.remove(blocks[3])  # from the middle
    assert blocks[3].prev_free_block is None and blocks[3].next_free_block is None
    assert ids(q.get_all_free_blocks()) == [1, 2, 4, 5]
    assert q.num_free_blocks == 4

    assert ids(q.popleft_n(2)) == [1, 2]
    q.append(blocks[0])
    q.append_n([blocks[3], blocks[1]])
    assert ids(q.get_all_free_blocks()) == [4, 5, 0, 3, 1]
    assert q.num_free_blocks == 5

    q.remove(blocks[1])  # the tail
    q.remove(blocks[4])  # the head
    assert ids(q.get_all_free_blocks()) == [5, 0, 3]
    assert ids(q.popleft_n(3)) == [5, 0, 3]
    assert q.num_free_blocks == 0 and q.get_all_free_blocks() == []
    with pytest.raises(ValueError):
        q.popleft()
    with pytest.raises(RuntimeError):
        q.remove(blocks[2])  # not in the queue


def test_free_order_is_lru_tail_first() -> None:
    """A request's blocks go back to the tail in reverse, and the oldest free
    block is reused first."""
    mgr = make_manager(9)
    pool = mgr.block_pool
    a, b = make_request("a", list(range(10))), make_request("b", list(range(100, 110)))
    blocks_a = mgr.allocate_slots(a, 10)
    blocks_b = mgr.allocate_slots(b, 10)
    assert blocks_a is not None and blocks_b is not None
    assert blocks_a.get_block_ids() == ([1, 2, 3],)
    assert blocks_b.get_block_ids() == ([4, 5, 6],)
    mgr.free(a)
    mgr.free(b)
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [7, 8, 3, 2, 1, 6, 5, 4]
    c = make_request("c", list(range(200, 216)))
    new_c = mgr.allocate_slots(c, 16)
    assert new_c is not None and new_c.get_block_ids() == ([7, 8, 3, 2],)
    check_pool(pool)


# --- block hashes ------------------------------------------------------------


def test_hash_chaining() -> None:
    base = list(range(10))  # 2 full blocks + 2 tokens
    r1, r2 = make_request("1", base), make_request("2", list(base))
    assert len(r1.block_hashes) == 2  # the partial block is not hashed
    assert r1.block_hashes == r2.block_hashes
    assert r1.block_hashes[0] == hash_block_tokens(sha256, None, [0, 1, 2, 3])
    assert r1.block_hashes[0] == hash_block_tokens(sha256, NONE_HASH, [0, 1, 2, 3])
    assert r1.block_hashes[1] == hash_block_tokens(sha256, r1.block_hashes[0], [4, 5, 6, 7])

    # One token differs in block 1: block 0 still matches, every block from 1 on differs.
    other = list(base) + [10, 11, 12]
    other[5] = 99
    r3 = make_request("3", other)
    assert len(r3.block_hashes) == 3
    assert r3.block_hashes[0] == r1.block_hashes[0]
    assert r3.block_hashes[1] != r1.block_hashes[1]
    # Block 2 has the same tokens as an unmodified run would, but a different parent.
    r4 = make_request("4", list(base) + [10, 11, 12])
    assert r3.block_hashes[2] != r4.block_hashes[2]

    # Same tokens in another position: the chain makes the hash differ.
    assert hash_block_tokens(sha256, r1.block_hashes[0], [0, 1, 2, 3]) != r1.block_hashes[0]


def test_hasher_hashes_only_newly_full_blocks() -> None:
    r = make_request("r", list(range(6)))
    assert len(r.block_hashes) == 1
    r.append_output_token_ids(6)
    assert len(r.block_hashes) == 1
    r.append_output_token_ids([7, 8])
    assert len(r.block_hashes) == 2
    # Incremental hashing equals hashing the full sequence at once.
    assert r.block_hashes == make_request("s", list(range(9))).block_hashes


def test_hash_fns() -> None:
    assert get_hash_fn_by_name("sha256") is sha256
    assert sha256((1, 2)) == sha256((1, 2)) and sha256((1, 2)) != sha256((2, 1))
    assert len(sha256((b"x", (1, 2), None))) == 32
    hasher = get_request_block_hasher(BS, sha256)
    params = SamplingParams(max_tokens=4)
    r = Request("b", list(range(8)), params, block_hasher=hasher)
    assert len(r.block_hashes) == 2 and r.block_hashes[0] != r.block_hashes[1]
    for name in ("md5", "builtin"):
        with pytest.raises(ValueError):
            get_hash_fn_by_name(name)


# --- BlockPool ---------------------------------------------------------------


def test_null_block_never_usable() -> None:
    pool = BlockPool(num_gpu_blocks=5, enable_caching=True, hash_block_size=BS)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 4
    assert 0 not in ids(pool.get_new_blocks(4))
    assert pool.get_usage() == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)


def test_touch_and_free_ref_counts() -> None:
    pool = BlockPool(num_gpu_blocks=6, enable_caching=True, hash_block_size=BS)
    blocks = pool.get_new_blocks(2)
    assert [b.ref_cnt for b in blocks] == [1, 1]
    pool.touch(blocks)  # a second request shares them
    assert [b.ref_cnt for b in blocks] == [2, 2]
    assert pool.get_num_free_blocks() == 3
    pool.free_blocks(reversed(blocks))
    assert [b.ref_cnt for b in blocks] == [1, 1]
    assert pool.get_num_free_blocks() == 3  # still held by one request
    pool.free_blocks(reversed(blocks))
    assert pool.get_num_free_blocks() == 5
    # A hit on a free block takes it out of the queue again.
    pool.touch([blocks[1]])
    assert blocks[1].ref_cnt == 1 and blocks[1] not in pool.free_block_queue.get_all_free_blocks()
    assert pool.get_num_free_blocks() == 4
    check_pool(pool)


def test_evicted_stale_hash_is_removed() -> None:
    mgr = make_manager(4)
    pool = mgr.block_pool
    a = make_request("a", list(range(8)))
    assert mgr.allocate_slots(a, 8) is not None
    h0, h1 = a.block_hashes
    assert pool.num_cached_blocks == 2
    cached = pool.get_cached_block(h0, [0])
    assert cached is not None and cached[0].block_id == 1
    mgr.free(a)
    # Freed blocks keep their hashes: still a hit.
    assert pool.num_cached_blocks == 2 and pool.get_cached_block(h1, [0]) is not None
    # Reusing all 3 free blocks evicts both cached ones (block 3 was never used).
    new = pool.get_new_blocks(3)
    assert sorted(ids(new)) == [1, 2, 3]
    assert pool.get_cached_block(h0, [0]) is None and pool.get_cached_block(h1, [0]) is None
    assert len(pool.cached_block_hash_to_block) == 0 and pool.num_cached_blocks == 0
    assert all(b.block_hash is None for b in new)
    check_pool(pool)


def test_reset_prefix_cache() -> None:
    mgr = make_manager(6, log_stats=True)
    a = make_request("a", list(range(8)))
    mgr.allocate_slots(a, 8)
    assert not mgr.reset_prefix_cache()  # a still holds blocks
    mgr.free(a)
    assert mgr.reset_prefix_cache()
    assert mgr.block_pool.num_cached_blocks == 0
    assert mgr.get_computed_blocks(make_request("b", list(range(9))))[1] == 0
    stats = mgr.make_prefix_cache_stats()
    assert stats is not None and stats.reset


# --- KVCacheManager ----------------------------------------------------------


def test_prefix_hit_capped_below_num_tokens() -> None:
    mgr = make_manager(16, log_stats=True)
    a = make_request("a", list(range(8)))
    assert mgr.allocate_slots(a, 8) is not None
    mgr.free(a)

    # Same 8 tokens: both blocks are cached, but the last token must be
    # recomputed, so only one whole block is a hit.
    b = make_request("b", list(range(8)))
    hit, n = mgr.get_computed_blocks(b)
    assert n == 4 and hit.get_block_ids() == ([1],)
    # One more token: both blocks hit.
    c = make_request("c", list(range(9)))
    hit, n = mgr.get_computed_blocks(c)
    assert n == 8 and hit.get_block_ids() == ([1, 2],)
    # A different first token: no hit at all.
    d = make_request("d", [99] + list(range(1, 9)))
    assert mgr.get_computed_blocks(d)[1] == 0

    stats = mgr.make_prefix_cache_stats()
    assert stats is not None
    assert (stats.requests, stats.queries, stats.hits) == (3, 8 + 9 + 9, 4 + 8 + 0)
    assert mgr.make_prefix_cache_stats() == type(stats)()  # reset after reading


def test_allocate_with_prefix_hits() -> None:
    mgr = make_manager(16)
    a = make_request("a", list(range(10)))
    assert mgr.allocate_slots(a, 10) is not None  # blocks 1, 2, 3
    b = make_request("b", list(range(8)) + [50, 51, 52, 53, 54])
    hit, n = mgr.get_computed_blocks(b)
    assert n == 8
    new = mgr.allocate_slots(b, 13 - n, n, hit)
    assert new is not None and new.get_block_ids() == ([4, 5],)  # only the new ones
    assert mgr.get_block_ids("b") == ([1, 2, 4, 5],)
    assert [blk.ref_cnt for blk in mgr.block_pool.blocks[1:6]] == [2, 2, 1, 1, 1]
    # Both requests share blocks 1 and 2.
    assert mgr.get_num_common_prefix_blocks("a") == [2]
    # b's third block (tokens 8..11) became full and cached.
    assert mgr.block_pool.get_cached_block(b.block_hashes[2], [0]) == [mgr.block_pool.blocks[4]]

    mgr.free(a)
    assert [blk.ref_cnt for blk in mgr.block_pool.blocks[1:4]] == [1, 1, 0]
    mgr.free(b)
    assert mgr.block_pool.get_num_free_blocks() == 15 and mgr.usage == 0.0
    check_pool(mgr.block_pool)


def test_allocate_slots_none_when_full() -> None:
    mgr = make_manager(5)
    a = make_request("a", list(range(12)))
    assert mgr.allocate_slots(a, 12) is not None  # 3 of 4 blocks
    b = make_request("b", list(range(100, 108)))
    assert mgr.allocate_slots(b, 8) is None  # needs 2, 1 free
    assert "b" not in req_to_blocks(mgr) and mgr.block_pool.get_num_free_blocks() == 1
    assert mgr.allocate_slots(b, 4) is not None  # a chunk that fits
    assert mgr.usage == 1.0
    # Decode of a fits in its last block until it is full.
    a.num_computed_tokens = 12
    assert mgr.allocate_slots(a, 1) is None
    check_pool(mgr.block_pool)


def test_evictable_hits_count_against_free_blocks() -> None:
    """A prefix hit on a free block uses up a free block too."""
    mgr = make_manager(5)
    a = make_request("a", list(range(8)))
    mgr.allocate_slots(a, 8)
    mgr.free(a)  # free queue: [3, 4, 2, 1]; blocks 1, 2 cached
    x = make_request("x", list(range(100, 108)))
    assert mgr.allocate_slots(x, 8) is not None  # takes 3, 4
    b = make_request("b", list(range(12)))
    hit, n = mgr.get_computed_blocks(b)
    assert n == 8 and hit.get_block_ids() == ([1, 2],)
    # 1 new block + 2 free hits = 3 > 2 free: must not fit.
    assert mgr.allocate_slots(b, 12 - n, n, hit) is None
    assert mgr.block_pool.get_num_free_blocks() == 2
    mgr.free(x)
    assert mgr.allocate_slots(b, 12 - n, n, hit) is not None
    assert mgr.get_block_ids("b")[0][:2] == [1, 2]
    check_pool(mgr.block_pool)


def test_no_caching() -> None:
    mgr = make_manager(8, enable_caching=False)
    a = make_request("a", list(range(8)))
    mgr.allocate_slots(a, 8)
    assert mgr.block_pool.num_cached_blocks == 0
    mgr.free(a)
    assert mgr.get_computed_blocks(make_request("b", list(range(9)))) == (
        mgr.empty_kv_cache_blocks,
        0,
    )


def test_kv_cache_blocks() -> None:
    b1, b2 = KVCacheBlock(1), KVCacheBlock(2)
    x = KVCacheBlocks(([b1],)) + KVCacheBlocks(([b2],))
    assert x.get_block_ids() == ([1, 2],)
    assert x.new_empty().get_block_ids() == ([],)
    assert x.new_empty().get_block_ids(allow_none=True) is None
    assert x.get_unhashed_block_ids() == [1, 2]


def test_coordinator_holds_one_full_attention_manager() -> None:
    """vLLM's layers: KVCacheManager -> KVCacheCoordinator -> one
    SingleTypeKVCacheManager per KV cache group, which holds the block tables."""
    from tracevllm.core.kv_cache_coordinator import UnitaryKVCacheCoordinator
    from tracevllm.core.single_type_kv_cache_manager import FullAttentionManager

    mgr = make_manager(8)
    assert isinstance(mgr.coordinator, UnitaryKVCacheCoordinator)
    (manager,) = mgr.coordinator.single_type_managers
    assert isinstance(manager, FullAttentionManager)
    assert manager.block_pool is mgr.block_pool and manager.kv_cache_group_id == 0
    a = make_request("a", list(range(6)))
    assert mgr.allocate_slots(a, 6) is not None
    assert ids(manager.req_to_blocks["a"]) == [1, 2] and manager.num_cached_block["a"] == 1
    assert mgr.coordinator.get_blocks("a") == (manager.req_to_blocks["a"],)


# --- what the step view reads ------------------------------------------------------

# The KV manager's and block pool's internals: the step view must not read them.
KV_INTERNALS = {
    "req_to_blocks",
    "num_cached_block",
    "coordinator",
    "single_type_managers",
    "free_block_queue",
    "fake_free_list_head",
    "next_free_block",
    "prev_free_block",
    "cached_block_hash_to_block",
}


def test_step_view_reads_the_kv_cache_through_public_accessors() -> None:
    tree = ast.parse(inspect.getsource(step_view.record_schedule))
    names = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    assert not names & KV_INTERNALS, names & KV_INTERNALS
    # Nothing private (Python's own dunders, such as a class's __name__, are public).
    assert not [n for n in names if n.startswith("_") and not n.endswith("__")]


def test_step_view_kv_figures_match_the_pool() -> None:
    """A freed request's full blocks stay cached in the free queue: the view's
    cached-free count and queue head, from the accessors, are the pool's own."""
    model_config = ModelConfig(
        model="fake",
        hf_config={"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096},
        max_model_len=32,
    )
    cache_config = CacheConfig(block_size=BS)
    cache_config.num_gpu_blocks = 8
    sched = Scheduler(VllmConfig(model_config, cache_config, SchedulerConfig(64, 8, 32)))
    sched.add_request(make_request("a", list(range(9))))  # blocks 1 2 (full) 3
    sched.schedule()
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    sched.add_request(make_request("b", list(range(100, 105))))  # blocks 4 5
    so = sched.schedule()

    span = TracerProvider().get_tracer("test").start_span("Scheduler.schedule")
    step_view.record_schedule(span, so, sched)
    assert span.attributes is not None
    kv = json.loads(str(span.attributes[SpanAttributes.STEP_VIEW]))["kv"]
    pool = sched.kv_cache_manager.block_pool
    free = pool.free_block_queue.get_all_free_blocks()
    assert kv["cached_free"] == sum(b.block_hash is not None for b in free) == 2
    assert kv["free_queue_head"] == [[b.block_id, b.block_hash is not None] for b in free]
    assert [i for i, _ in kv["free_queue_head"]] == [6, 7, 3, 2, 1]
    assert (kv["total"], kv["free"], kv["used"]) == (7, 5, 2)
    assert pool.peek_free_blocks(2) == free[:2]
    assert sched.kv_cache_manager.get_num_cached_free_blocks() == 2
