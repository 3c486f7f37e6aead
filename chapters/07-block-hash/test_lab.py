"""Lab 07 tests: the block hasher, alone, on growing requests, and behind a
real prefix-cache lookup."""

from __future__ import annotations

import random

import pytest
from _labkit import load

from tracevllm.core.kv_cache_manager import KVCacheManager
from tracevllm.core.kv_cache_utils import NONE_HASH, hash_block_tokens, sha256
from tracevllm.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from tracevllm.request import Request
from tracevllm.sampling_params import SamplingParams

get_request_block_hasher = load(__file__, "get_request_block_hasher")
BS = 4


def make_request(req_id: str, prompt: list[int], block_size: int = BS) -> Request:
    hasher = get_request_block_hasher(block_size, sha256)
    return Request(req_id, prompt, SamplingParams(max_tokens=8), block_hasher=hasher)


def chain(tokens: list[int], block_size: int = BS) -> list[bytes]:
    """The hashes of every full block, by the definition: each block's hash
    covers its parent's hash and its own tokens."""
    hashes: list[bytes] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else NONE_HASH
        hashes.append(sha256((parent, tuple(tokens[start : start + block_size]), None)))
    return hashes


def test_one_hash_per_full_block() -> None:
    request = make_request("a", list(range(10)))  # blocks [0-3] [4-7], then 2 tokens
    assert request.block_hashes == chain(list(range(10)))
    assert len(request.block_hashes) == 2


def test_the_first_block_chains_on_none_hash() -> None:
    request = make_request("a", [7, 8, 9, 10])
    assert request.block_hashes == [hash_block_tokens(sha256, None, [7, 8, 9, 10])]
    assert request.block_hashes[0] == sha256((NONE_HASH, (7, 8, 9, 10), None))


def test_a_hash_names_the_whole_prefix() -> None:
    shared = list(range(100, 108))
    a = make_request("a", [*shared, 1, 2, 3, 4])
    b = make_request("b", [*shared, 1, 2, 3, 5])
    assert a.block_hashes[:2] == b.block_hashes[:2]  # the same first 8 tokens
    assert a.block_hashes[2] != b.block_hashes[2]
    # One token changed in the first block: no block after it can match.
    c = make_request("c", [999, *shared[1:], 1, 2, 3, 4])
    assert all(x != y for x, y in zip(a.block_hashes, c.block_hashes))
    # The same tokens in a later block, under another prefix, hash differently.
    d = make_request("d", [1, 2, 3, 4, 1, 2, 3, 4])
    assert d.block_hashes[0] != d.block_hashes[1]


def test_blocks_are_hashed_as_tokens_arrive() -> None:
    request = make_request("a", [1, 2, 3])  # no full block yet
    assert request.block_hashes == []
    seen = []
    for token in range(4, 14):
        request.append_output_token_ids(token)
        seen.append(len(request.block_hashes))
    # After tokens 4, 8 and 12 a block is full (sizes 4, 8, 12).
    assert seen == [1, 1, 1, 1, 2, 2, 2, 2, 3, 3]
    assert request.block_hashes == chain(list(range(1, 14)))


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_random_growth_against_the_definition(block_size: int) -> None:
    rng = random.Random(block_size)
    for trial in range(10):
        prompt = [rng.randrange(1000) for _ in range(rng.randrange(1, 40))]
        request = make_request(f"r{trial}", prompt, block_size)
        tokens = list(prompt)
        for _ in range(5):
            new = [rng.randrange(1000) for _ in range(rng.randrange(1, 9))]
            request.append_output_token_ids(new)
            tokens += new
            expected = chain(tokens, block_size)
            assert request.block_hashes == expected, (
                f"block_size={block_size}, tokens={tokens}: got {len(request.block_hashes)} "
                f"hashes, expected {len(expected)} (or the values differ)"
            )


def test_the_prefix_cache_finds_a_shared_prefix() -> None:
    """The KV cache manager's lookup walks these hashes: the second request
    hits the first one's two full blocks, and misses from the third on."""
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype="float32")
    config = KVCacheConfig(16, [], [KVCacheGroupSpec(["layer"], spec)])
    manager = KVCacheManager(config, max_model_len=64, hash_block_size=BS, enable_caching=True)
    a = make_request("a", list(range(10)))
    assert manager.allocate_slots(a, 10) is not None
    b = make_request("b", [*range(8), 50, 51, 52])
    blocks, num_hit_tokens = manager.get_computed_blocks(b)
    assert num_hit_tokens == 8
    assert [blk.block_id for blk in blocks.blocks[0]] == manager.get_block_ids("a")[0][:2]
