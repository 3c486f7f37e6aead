"""Lab 07: the prefix cache's block hash chain. Your version of
``tracevllm.core.kv_cache_utils.get_request_block_hasher``.

Read README.md first. Test it with ``make lab CH=07``; watch real requests hit
the prefix cache through your hashes with ``TRACEVLLM_LAB=07 make trace PROMPT="..."``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tracevllm.core.kv_cache_utils import BlockHash, hash_block_tokens  # noqa: F401 (yours to call)

if TYPE_CHECKING:
    from tracevllm.request import Request


def get_request_block_hasher(
    block_size: int, caching_hash_fn: Callable[[Any], bytes]
) -> Callable[[Request], list[BlockHash]]:
    """The hasher ``Request`` calls whenever tokens are appended: it returns the
    hashes of the blocks that became full since the last call."""

    def request_block_hasher(request: Request) -> list[BlockHash]:
        # request.all_token_ids: every token so far (prompt, then outputs).
        # request.block_hashes: the hashes returned by earlier calls, one per
        #                       full block, in order.
        # TODO 1: which block comes next? The first one without a hash.
        # TODO 2: its parent hash: the hash of the block before it, or None for
        #         a request's first block (hash_block_tokens turns None into
        #         NONE_HASH).
        # TODO 3: while the next block is full, hash it with
        #         hash_block_tokens(caching_hash_fn, parent, its block_size token ids),
        #         and let that hash be the parent of the block after it.
        # TODO 4: return the new hashes only; a partial last block gets none.
        raise NotImplementedError("Lab 07: the block hasher (see chapters/07-block-hash)")

    return request_block_hasher
