"""Lab 02 tests: allocate_slots on a real KVCacheManager and BlockPool."""

from __future__ import annotations

import types

import pytest
from _labkit import load

from tracevllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from tracevllm.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from tracevllm.core.kv_cache_utils import (
    KVCacheBlock,
    get_request_block_hasher,
    make_block_hash_with_group_id,
    sha256,
)
from tracevllm.core.sched.scheduler import Scheduler
from tracevllm.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from tracevllm.request import Request
from tracevllm.sampling_params import SamplingParams

allocate_slots = load(__file__, "allocate_slots")

BS = 4  # block size


def make_manager(
    num_gpu_blocks: int = 10, max_model_len: int = 64, enable_caching: bool = True
) -> KVCacheManager:
    """A manager whose allocate_slots is the function under test. Block 0 is
    the null block: ``num_gpu_blocks - 1`` are usable, 1, 2, ... in order."""
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype="float32")
    config = KVCacheConfig(num_gpu_blocks, [], [KVCacheGroupSpec(["layer"], spec)])
    mgr = KVCacheManager(config, max_model_len, hash_block_size=BS, enable_caching=enable_caching)
    mgr.allocate_slots = types.MethodType(allocate_slots, mgr)  # type: ignore[method-assign]
    return mgr


def make_request(req_id: str, prompt: list[int]) -> Request:
    params = SamplingParams(max_tokens=16, temperature=0)
    params.update_from_generation_config({}, 2)
    return Request(req_id, prompt, params, block_hasher=get_request_block_hasher(BS, sha256))


def req_to_blocks(mgr: KVCacheManager) -> dict[str, list[KVCacheBlock]]:
    """The block tables, kept by the one KV cache group's manager."""
    return mgr.coordinator.single_type_managers[0].req_to_blocks


def held(mgr: KVCacheManager, req_id: str) -> list[int]:
    return [b.block_id for b in req_to_blocks(mgr).get(req_id, [])]


def ran(req: Request, num_tokens: int, sampled: list[int] | None = None) -> None:
    """What the step does after allocation: the tokens are computed, maybe one sampled."""
    req.num_computed_tokens += num_tokens
    if sampled:
        req.append_output_token_ids(sampled)


def test_a_prompt_gets_the_blocks_it_fills() -> None:
    mgr = make_manager()
    a = make_request("a", list(range(10)))
    new = mgr.allocate_slots(a, 10)
    assert isinstance(new, KVCacheBlocks)
    assert new.get_block_ids() == ([1, 2, 3],)  # ceil(10 / 4) blocks, from the free queue
    assert held(mgr, "a") == [1, 2, 3]
    assert mgr.block_pool.get_num_free_blocks() == 9 - 3
    assert [mgr.block_pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [1, 1, 1]


def test_zero_new_tokens_is_an_error() -> None:
    mgr = make_manager()
    with pytest.raises(ValueError):
        mgr.allocate_slots(make_request("a", [1, 2, 3]), 0)
    assert held(mgr, "a") == []


def test_decodes_fill_the_last_block_before_taking_a_new_one() -> None:
    mgr = make_manager()
    a = make_request("a", list(range(10)))
    mgr.allocate_slots(a, 10)
    ran(a, 10, sampled=[100])
    got = []
    for token in (101, 102, 103):  # 11th, 12th, 13th token
        new = mgr.allocate_slots(a, 1)
        assert new is not None
        got.append(new.get_block_ids())
        ran(a, 1, sampled=[token])
    assert got == [([],), ([],), ([4],)]
    assert held(mgr, "a") == [1, 2, 3, 4]


def test_chunked_prefill_grows_the_block_list() -> None:
    mgr = make_manager()
    a = make_request("a", list(range(14)))
    assert mgr.allocate_slots(a, 6).get_block_ids() == ([1, 2],)
    ran(a, 6)
    assert mgr.allocate_slots(a, 6).get_block_ids() == ([3],)  # 12 tokens: 3 blocks
    ran(a, 6)
    assert mgr.allocate_slots(a, 2).get_block_ids() == ([4],)
    assert held(mgr, "a") == [1, 2, 3, 4]


def test_not_enough_free_blocks_returns_none_and_changes_nothing() -> None:
    mgr = make_manager(num_gpu_blocks=4)  # 3 usable blocks
    a = make_request("a", list(range(13)))  # needs 4
    assert mgr.allocate_slots(a, 13) is None
    assert "a" not in req_to_blocks(mgr)
    assert mgr.block_pool.get_num_free_blocks() == 3
    assert mgr.allocate_slots(a, 12) is not None  # a chunk of 12 fits in 3 blocks
    assert held(mgr, "a") == [1, 2, 3]
    assert mgr.block_pool.get_num_free_blocks() == 0


def test_prefix_hits_are_shared_not_copied() -> None:
    mgr = make_manager()
    a = make_request("a", list(range(10)))
    mgr.allocate_slots(a, 10)  # blocks 1, 2 full (and cached), 3 partial
    b = make_request("b", list(range(8)) + [50, 51, 52, 53])  # shares a's first 8 tokens
    hits, num_hit_tokens = mgr.get_computed_blocks(b)
    assert [blk.block_id for blk in hits.blocks[0]] == [1, 2] and num_hit_tokens == 8
    new = mgr.allocate_slots(b, 12 - 8, num_hit_tokens, hits)
    assert new is not None
    assert new.get_block_ids() == ([4],)  # only the new block is returned
    assert held(mgr, "b") == [1, 2, 4]  # hits first, in token order
    assert [mgr.block_pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [2, 2, 1, 1]
    # The hits were cached; so is block 4 now.
    assert mgr.coordinator.single_type_managers[0].num_cached_block["b"] == 3
    assert mgr.block_pool.get_num_free_blocks() == 9 - 4


def test_a_hit_on_a_free_block_costs_a_free_block() -> None:
    mgr = make_manager(num_gpu_blocks=4)  # 3 usable blocks
    a = make_request("a", list(range(8)))
    mgr.allocate_slots(a, 8)
    mgr.free(a)  # blocks 1, 2 are free again, but keep their hashes
    assert mgr.block_pool.get_num_free_blocks() == 3

    # 13 tokens: 2 hit blocks + 2 new ones. Free blocks are 3, and the hits
    # themselves are two of them: 2 + 2 > 3, so it does not fit.
    b = make_request("b", list(range(8)) + [50, 51, 52, 53, 54])
    hits, num_hit_tokens = mgr.get_computed_blocks(b)
    assert num_hit_tokens == 8
    assert mgr.allocate_slots(b, 5, num_hit_tokens, hits) is None
    assert "b" not in req_to_blocks(mgr)
    assert mgr.block_pool.get_num_free_blocks() == 3
    assert [mgr.block_pool.blocks[i].ref_cnt for i in (1, 2)] == [0, 0]

    # 12 tokens: 2 hits + 1 new block = 3: fits exactly.
    c = make_request("c", list(range(8)) + [60, 61, 62, 63])
    hits, num_hit_tokens = mgr.get_computed_blocks(c)
    new = mgr.allocate_slots(c, 4, num_hit_tokens, hits)
    assert new is not None and new.get_block_ids() == ([3],)
    assert held(mgr, "c") == [1, 2, 3]
    assert mgr.block_pool.get_num_free_blocks() == 0


def test_full_blocks_are_cached_as_soon_as_they_are_allocated() -> None:
    mgr = make_manager()
    a = make_request("a", list(range(10)))
    mgr.allocate_slots(a, 6)  # tokens 0..5: block 1 full
    assert mgr.block_pool.num_cached_blocks == 1
    ran(a, 6)
    mgr.allocate_slots(a, 4)  # tokens 6..9: block 2 full, block 3 not
    assert mgr.block_pool.num_cached_blocks == 2
    # Each under its hash and KV cache group 0 (the key vLLM caches a block by).
    keys = [make_block_hash_with_group_id(h, 0) for h in a.block_hashes[:2]]
    assert [mgr.block_pool.blocks[i].block_hash for i in (1, 2)] == keys
    assert mgr.block_pool.blocks[3].block_hash is None

    off = make_manager(enable_caching=False)
    off.allocate_slots(make_request("a", list(range(10))), 10)
    assert off.block_pool.num_cached_blocks == 0


def test_lookahead_slots_capped_at_max_model_len() -> None:
    for max_model_len, expected in ((64, [4, 5]), (16, [4])):
        mgr = make_manager(max_model_len=max_model_len)
        a = make_request("a", list(range(12)))
        mgr.allocate_slots(a, 12)
        ran(a, 12, sampled=[100])
        # 13 tokens + 4 lookahead (draft) tokens = 17 slots: 5 blocks, unless
        # max_model_len = 16 caps it at 4.
        new = mgr.allocate_slots(a, 1, num_lookahead_tokens=4)
        assert new is not None and new.get_block_ids() == (expected,), max_model_len
        # Lookahead tokens are not final: only the 3 full prompt blocks are cached.
        assert mgr.block_pool.num_cached_blocks == 3


def test_the_scheduler_runs_on_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two requests sharing a prefix, through the real Scheduler."""
    monkeypatch.setattr(KVCacheManager, "allocate_slots", allocate_slots)
    model_config = ModelConfig(
        model="fake",
        hf_config={"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096},
        max_model_len=64,
    )
    cache_config = CacheConfig(block_size=BS)
    cache_config.num_gpu_blocks = 16
    sched = Scheduler(VllmConfig(model_config, cache_config, SchedulerConfig(64, 8, 64)))
    sched.add_request(make_request("a", list(range(10))))
    so = sched.schedule()
    assert so.scheduled_new_reqs[0].block_ids == ([1, 2, 3],)
    sched.add_request(make_request("b", list(range(9)) + [70, 71]))
    so = sched.schedule()
    # b hits a's two full blocks (8 tokens) and gets one block of its own. (a
    # has nothing to run: no forward pass sampled its next token.)
    assert so.scheduled_new_reqs[0].block_ids == ([1, 2, 4],)
    assert so.num_scheduled_tokens == {"b": 3}
