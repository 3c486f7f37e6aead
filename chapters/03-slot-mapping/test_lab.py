"""Lab 03 tests: compute_slot_mapping on a real BlockTable."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from _labkit import load

from tracevllm.worker.block_table import PAD_SLOT_ID, BlockTable

compute_slot_mapping = load(__file__, "compute_slot_mapping")


def make_block_table(
    rows: list[list[int]], block_size: int = 4, max_tokens: int = 64
) -> BlockTable:
    """A block table whose compute_slot_mapping is the function under test."""
    bt = BlockTable(
        max_num_reqs=8,
        max_num_blocks_per_req=64,
        max_num_batched_tokens=max_tokens,
        block_size=block_size,
    )
    for row, block_ids in enumerate(rows):
        bt.add_row(block_ids, row)
    bt.compute_slot_mapping = types.MethodType(compute_slot_mapping, bt)  # type: ignore[method-assign]
    return bt


def flatten(num_computed: list[int], num_scheduled: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(req_indices, positions) of a step, as ModelRunner._prepare_inputs builds them."""
    counts = np.array(num_scheduled)
    req_indices = np.repeat(np.arange(len(counts)), counts)
    starts = np.cumsum(counts) - counts
    query_pos = np.arange(counts.sum()) - np.repeat(starts, counts)
    positions = np.array(num_computed)[req_indices] + query_pos
    return req_indices, positions


def slow_slots(
    rows: list[list[int]], req_indices: np.ndarray, positions: np.ndarray, bs: int
) -> list[int]:
    return [rows[r][p // bs] * bs + p % bs for r, p in zip(req_indices, positions)]


def test_one_request() -> None:
    bt = make_block_table([[7, 2]])
    slots = bt.compute_slot_mapping(np.zeros(6, dtype=np.int64), np.arange(6))
    assert isinstance(slots, torch.Tensor) and slots.dtype == torch.int64
    assert slots.tolist() == [28, 29, 30, 31, 8, 9]


def test_a_mixed_batch() -> None:
    # a: a new 2-token prompt; b: 5 tokens of an 8-token prompt (chunked);
    # c: a decode at position 9; d: a chunk after a 4-token prefix-cache hit.
    rows = [[5], [2, 9], [3, 6, 1], [4, 8]]
    req_indices, positions = flatten(num_computed=[0, 0, 9, 4], num_scheduled=[2, 5, 1, 3])
    assert positions.tolist() == [0, 1, 0, 1, 2, 3, 4, 9, 4, 5, 6]
    bt = make_block_table(rows)
    slots = bt.compute_slot_mapping(req_indices, positions)
    assert slots.tolist() == [20, 21, 8, 9, 10, 11, 36, 5, 32, 33, 34]


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_random_batches_against_a_loop(block_size: int) -> None:
    rng = np.random.default_rng(block_size)
    for _ in range(20):
        num_reqs = int(rng.integers(1, 8))
        num_computed = rng.integers(0, 40, num_reqs).tolist()
        num_scheduled = rng.integers(1, 9, num_reqs).tolist()
        blocks_needed = [-(-(c + s) // block_size) for c, s in zip(num_computed, num_scheduled)]
        ids = rng.permutation(np.arange(1, 2000))
        rows, start = [], 0
        for n in blocks_needed:
            rows.append(ids[start : start + n].tolist())
            start += n
        req_indices, positions = flatten(num_computed, num_scheduled)
        bt = make_block_table(rows, block_size=block_size)
        slots = bt.compute_slot_mapping(req_indices, positions)
        expected = slow_slots(rows, req_indices, positions, block_size)
        assert slots.tolist() == expected, (
            f"block_size={block_size}, block table rows={rows}, "
            f"req_indices={req_indices.tolist()}, positions={positions.tolist()}: "
            f"got slots {slots.tolist()}, expected {expected}"
        )


def test_the_rest_of_the_buffer_is_padding() -> None:
    bt = make_block_table([[3, 5, 7]], max_tokens=16)
    bt.compute_slot_mapping(np.zeros(12, dtype=np.int64), np.arange(12))  # a big step
    slots = bt.compute_slot_mapping(np.zeros(3, dtype=np.int64), np.arange(4, 7))  # a small one
    assert slots.tolist() == [20, 21, 22]
    # The step's slots live in the table's buffer; stale slots of the big
    # step must not survive past them: the cache write skips PAD_SLOT_ID.
    assert bt.slot_mapping[:3].tolist() == [20, 21, 22]
    assert bt.slot_mapping[3:].tolist() == [PAD_SLOT_ID] * 13
