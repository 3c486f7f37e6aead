"""Block hashes, the KV block record and the free-block queue.

Mirrors vllm/v1/core/kv_cache_utils.py (``BlockHash``,
``BlockHashWithGroupId`` with ``make_block_hash_with_group_id`` /
``get_block_hash`` / ``get_group_id``, ``NONE_HASH``, ``init_none_hash``,
``hash_block_tokens``, ``get_request_block_hasher``, ``KVCacheBlock``,
``FreeKVCacheBlockQueue``) and the hash functions of vllm/utils/hashing.py
(``get_hash_fn_by_name``). vLLM's file also groups the layers and sizes the
KV cache; tracevllm keeps those in kv_cache_groups.py and kv_cache_sizing.py
and re-exports their names at the bottom of this module, so that ``from
...kv_cache_utils import get_kv_cache_configs`` works as in vLLM.

Left out: multimodal/LoRA/cache-salt extra keys (``extra_keys`` stays in the
signature, always None here), CBOR and xxhash, the eagle hasher, and hashing
at a finer block size than a group allocates (``BlockHashListWithBlockSize``:
tracevllm's groups all allocate at the hash block size).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NewType

from tracevllm.labs import lab_hook

if TYPE_CHECKING:
    from tracevllm.request import Request

# The hash of one full block of tokens, chained on the hash of the block before it.
BlockHash = NewType("BlockHash", bytes)

# A block hash with its KV cache group id appended (4 bytes, big-endian): the
# key of the prefix cache, since each group caches its own blocks for the same
# tokens. Bytes, not a tuple, so a key is one object.
BlockHashWithGroupId = NewType("BlockHashWithGroupId", bytes)


def make_block_hash_with_group_id(block_hash: BlockHash, group_id: int) -> BlockHashWithGroupId:
    return BlockHashWithGroupId(block_hash + group_id.to_bytes(4, "big", signed=False))


def get_block_hash(key: BlockHashWithGroupId) -> BlockHash:
    return BlockHash(key[:-4])


def get_group_id(key: BlockHashWithGroupId) -> int:
    return int.from_bytes(key[-4:], "big", signed=False)


def sha256(input: Any) -> bytes:
    """SHA-256 of the pickled object: stable across processes and runs."""
    return hashlib.sha256(pickle.dumps(input, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def get_hash_fn_by_name(hash_fn_name: str) -> Callable[[Any], bytes]:
    """``CacheConfig.prefix_caching_hash_algo`` -> hash function (vLLM: utils/hashing.py).

    vLLM also offers sha256_cbor, xxhash and xxhash_cbor; tracevllm has vLLM's default only.
    """
    if hash_fn_name == "sha256":
        return sha256
    raise ValueError(f"Unsupported hash function: {hash_fn_name}")


# The parent hash of the first block of every request. vLLM seeds it with
# os.urandom (or PYTHONHASHSEED); tracevllm uses a fixed seed so that block
# hashes in traces and views are the same from run to run.
NONE_HASH: BlockHash = BlockHash(sha256("tracevllm"))


def init_none_hash(hash_fn: Callable[[Any], bytes]) -> None:
    global NONE_HASH
    NONE_HASH = BlockHash(hash_fn("tracevllm"))


# --8<-- [start:hash_block_tokens]
def hash_block_tokens(
    hash_function: Callable[[Any], bytes],
    parent_block_hash: BlockHash | None,
    curr_block_token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> BlockHash:
    """Hash one full block: (parent hash, its token ids, extra keys).

    Chaining on the parent makes a block's hash name its whole prefix, so two
    requests share a block only if every token before it matches too.
    """
    parent = parent_block_hash or NONE_HASH
    return BlockHash(hash_function((parent, tuple(curr_block_token_ids), extra_keys)))


# --8<-- [end:hash_block_tokens]


@lab_hook("get_request_block_hasher")  # lab 07: chapters/07-block-hash
def get_request_block_hasher(
    block_size: int, caching_hash_fn: Callable[[Any], bytes]
) -> Callable[[Request], list[BlockHash]]:
    """The hasher ``Request`` calls whenever tokens are appended: it returns the
    hashes of the blocks that became full since the last call."""

    def request_block_hasher(request: Request) -> list[BlockHash]:
        start = len(request.block_hashes) * block_size
        parent = request.block_hashes[-1] if request.block_hashes else None
        token_ids = request.all_token_ids
        new_hashes: list[BlockHash] = []
        # One hash per newly full block; a partial last block is never hashed.
        while start + block_size <= len(token_ids):
            parent = hash_block_tokens(
                caching_hash_fn, parent, token_ids[start : start + block_size]
            )
            new_hashes.append(parent)
            start += block_size
        return new_hashes

    return request_block_hasher


@dataclass(slots=True)
class KVCacheBlock:
    """One KV cache block's metadata (its tensors live in the model runner)."""

    block_id: int
    # How many requests hold this block. 0: it is in the free queue.
    ref_cnt: int = 0
    # Its prefix-cache key (hash + group id), set once the block is full and
    # cached; kept after it is freed, so a later request can still hit it
    # until the block is evicted (reused).
    _block_hash: BlockHashWithGroupId | None = None
    # Links of the free queue; only FreeKVCacheBlockQueue touches them.
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None
    # Block 0, the placeholder of the block table: never allocated or cached.
    is_null: bool = False

    @property
    def block_hash(self) -> BlockHashWithGroupId | None:
        return self._block_hash

    @block_hash.setter
    def block_hash(self, block_hash: BlockHashWithGroupId) -> None:
        assert self._block_hash is None, f"block {self.block_id} already has a hash"
        self._block_hash = block_hash

    def reset_hash(self) -> None:
        """Forget the hash when the block is evicted."""
        self._block_hash = None

    def __repr__(self) -> str:
        # Not the dataclass repr: it would recurse through the free-queue links.
        h = self._block_hash.hex()[:8] if self._block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """The free blocks, as a doubly linked list threaded through the blocks.

    Python's deque cannot remove from the middle in O(1), which a prefix-cache
    hit on a free block needs. Order is the eviction order (LRU): allocation
    pops the head, freeing appends at the tail. A request frees its blocks in
    reverse, so that its tail (the longest, least shareable prefix) goes first.
    Fake head and tail blocks mean no branch for an empty list or an end.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = 0
        self.fake_free_list_head = KVCacheBlock(block_id=-1)
        self.fake_free_list_tail = KVCacheBlock(block_id=-1)
        self.fake_free_list_head.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = self.fake_free_list_head
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        if self.num_free_blocks == 0:
            raise ValueError("No free blocks available")
        block = self.fake_free_list_head.next_free_block
        assert block is not None
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        assert n <= self.num_free_blocks, f"asked for {n} of {self.num_free_blocks} free blocks"
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink a block from anywhere in the queue, in O(1)."""
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"remove() called on a block not in the free queue: {block}")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self.fake_free_list_tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The free blocks, head (next to evict) first. For tests and views."""
        ret = []
        curr = self.fake_free_list_head.next_free_block
        while curr is not None and curr is not self.fake_free_list_tail:
            ret.append(curr)
            curr = curr.next_free_block
        return ret


# vLLM's names for the grouping and sizing half of its kv_cache_utils.py (see
# the docstring).
from tracevllm.core.kv_cache_groups import (  # noqa: E402, F401
    create_kv_cache_group_specs,
    get_uniform_page_size,
    is_kv_cache_page_size_uniform,
    unify_kv_cache_spec_page_size,
)
from tracevllm.core.kv_cache_sizing import (  # noqa: E402, F401
    check_enough_kv_cache_memory,
    estimate_max_model_len,
    generate_scheduler_kv_cache_config,
    get_kv_cache_config_from_groups,
    get_kv_cache_configs,
    get_kv_cache_groups,
    get_max_concurrency_for_kv_cache_config,
    get_num_blocks,
    is_kv_cache_spec_uniform,
    max_memory_usage_bytes,
    may_override_num_blocks,
)
