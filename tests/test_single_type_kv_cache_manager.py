"""SlidingWindowManager with vLLM 0.22.0's signatures.

The ideas of vLLM's tests/v1/core/test_single_type_kv_cache_manager.py,
written again for tracevllm: the right-to-left cache-hit search, the blocks
freed as they fall out of the window, the allocation count of a request whose
prefix hit lies partly before its window, and, through ``KVCacheManager``, the
bound a long generation stays under.
"""

from __future__ import annotations

import pytest

from tracevllm.core.block_pool import BlockPool
from tracevllm.core.kv_cache_manager import KVCacheManager
from tracevllm.core.kv_cache_utils import (
    BlockHash,
    KVCacheBlock,
    get_request_block_hasher,
    make_block_hash_with_group_id,
    sha256,
)
from tracevllm.core.single_type_kv_cache_manager import (
    SlidingWindowManager,
    get_manager_for_kv_cache_spec,
)
from tracevllm.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from tracevllm.request import Request
from tracevllm.sampling_params import SamplingParams
from tracevllm.utils.math_utils import cdiv


def sliding_spec(window: int, block_size: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype="float32", sliding_window=window
    )


def make_manager(window: int, block_size: int, num_blocks: int = 100) -> SlidingWindowManager:
    pool = BlockPool(num_gpu_blocks=num_blocks, enable_caching=True, hash_block_size=block_size)
    manager = get_manager_for_kv_cache_spec(
        sliding_spec(window, block_size),
        max_num_batched_tokens=64,
        max_model_len=1024,
        block_pool=pool,
        enable_caching=True,
        kv_cache_group_id=0,
    )
    assert isinstance(manager, SlidingWindowManager)
    return manager


def test_get_num_skipped_tokens_is_vllms_example() -> None:
    """W = 4, 7 computed: token 7 sees 4 .. 7, so 0 .. 3 are skipped."""
    manager = make_manager(window=4, block_size=2)
    assert [manager.get_num_skipped_tokens(n) for n in range(9)] == [0, 0, 0, 0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    ("window", "cached", "expected"),
    [
        # W = 4: a run of cdiv(4 - 1, 2) = 2 ends the right-to-left search; what
        # lies before it is taken as the null block, what lies past it is dropped.
        (4, "TTTFFTTFTTF", "NNNNNNNNTT"),
        (4, "FTTFF", "NTT"),
        # No run long enough: the leading run alone (the window reaches token 0).
        (4, "TFTFT", "T"),
        (4, "FTFTF", ""),
        (4, "TTTTTF", "NNNTT"),
        # W = 3: the next token needs 2 tokens before it, one block.
        (3, "TTTFFTTFTTF", "NNNNNNNNNT"),
        (3, "FTFTF", "NNNT"),
    ],
)
def test_sliding_window_possible_cached_prefix(window: int, cached: str, expected: str) -> None:
    block_size = 2
    manager = make_manager(window, block_size)
    pool = manager.block_pool
    block_hashes = [BlockHash(sha256(i)) for i in range(len(cached))]
    for i, is_cached in enumerate(cached):
        if is_cached == "T":
            key = make_block_hash_with_group_id(block_hashes[i], 0)
            pool.cached_block_hash_to_block.insert(key, pool.blocks[i + 10])
    (hit,) = SlidingWindowManager.find_longest_cache_hit(
        block_hashes=block_hashes,
        max_length=len(cached) * block_size,
        kv_cache_group_ids=[0],
        block_pool=pool,
        kv_cache_spec=manager.kv_cache_spec,
        use_eagle=False,
        alignment_tokens=block_size,
    )
    assert "".join("N" if b.is_null else "T" for b in hit) == expected
    assert all(b is pool.blocks[i + 10] for i, b in enumerate(hit) if not b.is_null)


def test_sliding_window_remove_skipped_blocks() -> None:
    """Blocks wholly before the window go back to the pool; the null block takes their place."""
    block_size, window = 2, 4
    manager = make_manager(window, block_size, num_blocks=30)
    pool = manager.block_pool
    blocks = pool.get_new_blocks(10)
    manager.req_to_blocks["r"] = list(blocks)
    free_before = pool.get_num_free_blocks()

    def nulls() -> str:
        return "".join("N" if b.is_null else "B" for b in manager.req_to_blocks["r"])

    manager.remove_skipped_blocks("r", 4)  # skips token 0: no whole block
    assert nulls() == "B" * 10
    manager.remove_skipped_blocks("r", 5)  # skips 0, 1: block 0
    assert nulls() == "N" + "B" * 9
    manager.remove_skipped_blocks("r", 10)  # skips 0 .. 6: blocks 0 .. 2
    assert nulls() == "NNN" + "B" * 7
    manager.remove_skipped_blocks("r", 10)  # again: nothing more
    assert manager.num_skipped_blocks_freed == 3
    assert pool.get_num_free_blocks() == free_before + 3
    free = pool.free_block_queue.get_all_free_blocks()
    assert free[-3:] == [blocks[0], blocks[2], blocks[1]]  # the earlier call's first
    assert all(b.ref_cnt == 0 for b in blocks[:3])
    manager.free("r")
    assert pool.get_num_free_blocks() == 29  # all but the null block


def test_get_num_blocks_to_allocate_skips_hits_before_the_window() -> None:
    """A new request whose prefix hit reaches past its window: the hit's blocks
    before the window are not touched, so they cost nothing, even if evictable."""
    block_size, window = 2, 4
    manager = make_manager(window, block_size, num_blocks=30)
    pool = manager.block_pool
    hits = pool.get_new_blocks(8)  # 16 tokens of hits
    pool.free_blocks(hits)  # all evictable (ref_cnt 0)
    # 16 computed tokens: skipped 16 - 4 + 1 = 13 -> 6 whole blocks before the window.
    num = manager.get_num_blocks_to_allocate(
        "new",
        num_tokens=20,
        new_computed_blocks=hits,
        total_computed_tokens=16,
        num_tokens_main_model=20,
    )
    # 2 evictable hits in the window, 2 new blocks for tokens 16 .. 19.
    assert num == 2 + 2
    manager.allocate_new_computed_blocks("new", hits, 16, 0)
    assert [b.is_null for b in manager.req_to_blocks["new"]] == [True] * 6 + [False] * 2
    assert [b.ref_cnt for b in hits] == [0] * 6 + [1] * 2


def _request(prompt: list[int], block_size: int) -> Request:
    params = SamplingParams(max_tokens=200, temperature=0)
    params.update_from_generation_config({}, 2)
    return Request("r", prompt, params, block_hasher=get_request_block_hasher(block_size, sha256))


@pytest.mark.parametrize("window", [4, 5, 8, 13])
def test_long_generation_holds_a_bounded_window(window: int) -> None:
    """Prefill in chunks, then 100 decodes: after each allocation the request
    holds at most cdiv(W - 1 + chunk, bs) + 1 blocks (cdiv(W, bs) + 1 while it
    decodes), exactly the blocks of its window, and the pool gets the rest back."""
    block_size, chunk = 4, 8
    spec = sliding_spec(window, block_size)
    config = KVCacheConfig(30, [], [KVCacheGroupSpec(["layer"], spec)])
    mgr = KVCacheManager(config, max_model_len=1024, hash_block_size=block_size)
    pool = mgr.block_pool
    req = _request(list(range(30)), block_size)
    max_decode_held = 0
    while req.num_output_tokens < 100:
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        assert mgr.allocate_slots(req, n) is not None
        ids = mgr.get_block_ids("r")[0]
        held = [b for b in ids if b != 0]
        computed = req.num_computed_tokens
        # The first of this step's tokens sees back to computed - W + 1.
        skipped_blocks = max(0, computed - window + 1) // block_size
        assert ids[:skipped_blocks] == [0] * skipped_blocks
        assert 0 not in ids[skipped_blocks:]
        assert len(ids) == cdiv(computed + n, block_size)
        assert len(held) <= spec.max_admission_blocks_per_request(chunk, 1024)
        assert pool.get_num_free_blocks() == 29 - len(held)
        if n == 1:
            max_decode_held = max(max_decode_held, len(held))
        req.num_computed_tokens += n
        if req.num_computed_tokens == req.num_tokens:
            req.append_output_token_ids(7)
    assert max_decode_held <= cdiv(window, block_size) + 1
    manager = mgr.coordinator.single_type_managers[0]
    assert manager.num_skipped_blocks_freed == ids.count(0) > 0  # every null was a freed block
    mgr.free(req)
    assert pool.get_num_free_blocks() == 29


def test_free_skips_the_null_blocks() -> None:
    """free() hands back the request's real blocks; the null blocks in its table stay out."""
    manager = make_manager(window=4, block_size=2, num_blocks=12)
    pool = manager.block_pool
    manager.req_to_blocks["r"] = pool.get_new_blocks(6)
    manager.remove_skipped_blocks("r", 9)
    manager.free("r")
    free = pool.free_block_queue.get_all_free_blocks()
    assert pool.null_block not in free and len(free) == 11
    assert isinstance(free[0], KVCacheBlock)
