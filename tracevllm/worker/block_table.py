"""The runner's copy of every running request's block table.

Mirrors vllm/v1/worker/block_table.py (``BlockTable``,
``MultiGroupBlockTable``): one ``BlockTable`` per KV cache group, since each
group has its own blocks for the same tokens (a Llama has one group; Gemma-2
two: its sliding-window layers' blocks and its full layers'). The scheduler
sends block ids as ``tuple[list[int], ...]``, one list per group, and
``MultiGroupBlockTable`` hands each table its list. Left out: hybrid (kernel
vs. allocation) block sizes, the alignment of the table's width for TRTLLM,
context parallelism, the pinned CPU / GPU double buffer (one tensor here,
copied to the device when asked), and the Triton slot-mapping kernel (numpy
does it on the CPU).

A sliding-window group's row keeps the ids of blocks the KV manager has
since freed (the scheduler sends only new blocks); the attention read starts
at the window, so those stale entries are never read.

Rows are indexed like the persistent batch (``InputBatch``): row i holds
the physical block ids of request ``req_ids[i]``, logical block j in column j.
"""

from __future__ import annotations

import numpy as np
import torch

from tracevllm.labs import lab_hook

# Slot id of padding tokens: the cache write skips them (vLLM's PAD_SLOT_ID).
PAD_SLOT_ID = -1


class BlockTable:
    def __init__(
        self,
        max_num_reqs: int,
        max_num_blocks_per_req: int,
        max_num_batched_tokens: int,
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_num_blocks_per_req = max_num_blocks_per_req
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = block_size
        self.device = torch.device(device)
        # [max_num_reqs, max_num_blocks_per_req]; the numpy view shares memory.
        self.block_table = torch.zeros((max_num_reqs, max_num_blocks_per_req), dtype=torch.int32)
        self.block_table_np = self.block_table.numpy()
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)
        # [max_num_batched_tokens], int64
        self.slot_mapping = torch.zeros(max_num_batched_tokens, dtype=torch.int64)
        self.slot_mapping_np = self.slot_mapping.numpy()

    def append_row(self, block_ids: list[int], row_idx: int) -> None:
        """Add blocks the scheduler allocated this step at the end of the row."""
        if not block_ids:
            return
        start = int(self.num_blocks_per_row[row_idx])
        self.num_blocks_per_row[row_idx] += len(block_ids)
        self.block_table_np[row_idx, start : start + len(block_ids)] = block_ids

    def add_row(self, block_ids: list[int], row_idx: int) -> None:
        """Fill a row from scratch (a new or resumed request)."""
        self.num_blocks_per_row[row_idx] = 0
        self.append_row(block_ids, row_idx)

    def clear_row(self, row_idx: int) -> None:
        n = int(self.num_blocks_per_row[row_idx])
        self.block_table_np[row_idx, :n] = 0
        self.num_blocks_per_row[row_idx] = 0

    def move_row(self, src: int, tgt: int) -> None:
        """Copy row ``src`` onto row ``tgt`` (condensing the batch)."""
        n = int(self.num_blocks_per_row[src])
        self.block_table_np[tgt, :n] = self.block_table_np[src, :n]
        self.num_blocks_per_row[tgt] = n

    def swap_row(self, src: int, tgt: int) -> None:
        self.num_blocks_per_row[[src, tgt]] = self.num_blocks_per_row[[tgt, src]]
        self.block_table_np[[src, tgt]] = self.block_table_np[[tgt, src]]

    # --8<-- [start:compute_slot_mapping]
    @lab_hook("compute_slot_mapping")  # lab 03: chapters/03-slot-mapping
    def compute_slot_mapping(self, req_indices: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        """Cache slot of every token in the batch: the page table lookup.

        Token at position p of row r lives in physical block
        ``block_table[r, p // block_size]``, at offset ``p % block_size``.
        E.g. block_size 4, row [7, 2]: positions 0..5 -> slots 28 29 30 31 8 9.
        """
        num_tokens = positions.shape[0]
        block_numbers = self.block_table_np[req_indices, positions // self.block_size]
        slots = block_numbers.astype(np.int64) * self.block_size + positions % self.block_size
        self.slot_mapping_np[:num_tokens] = slots
        self.slot_mapping_np[num_tokens:] = PAD_SLOT_ID
        return self.slot_mapping[:num_tokens]

    # --8<-- [end:compute_slot_mapping]

    def get_device_tensor(self, num_reqs: int) -> torch.Tensor:
        """Rows of the first ``num_reqs`` requests, on the model's device."""
        return self.block_table[:num_reqs].to(self.device, non_blocking=True)

    def get_cpu_tensor(self) -> torch.Tensor:
        return self.block_table

    def get_numpy_array(self) -> np.ndarray:
        return self.block_table_np


class MultiGroupBlockTable:
    """The BlockTables for each KV cache group."""

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        device: torch.device | str,
        block_sizes: list[int],
        max_num_blocks: list[int] | None = None,
    ) -> None:
        if max_num_blocks is None:
            max_num_blocks = [-(-max_model_len // block_size) for block_size in block_sizes]
        if len(max_num_blocks) != len(block_sizes):
            raise ValueError(
                f"max_num_blocks length ({len(max_num_blocks)}) "
                f"must match block_sizes length ({len(block_sizes)})"
            )
        self.block_tables = [
            BlockTable(max_num_reqs, n, max_num_batched_tokens, block_size, device)
            for block_size, n in zip(block_sizes, max_num_blocks, strict=True)
        ]

    def append_row(self, block_ids: tuple[list[int], ...], row_idx: int) -> None:
        for i, block_table in enumerate(self.block_tables):
            block_table.append_row(block_ids[i], row_idx)

    def add_row(self, block_ids: tuple[list[int], ...], row_idx: int) -> None:
        for i, block_table in enumerate(self.block_tables):
            block_table.add_row(block_ids[i], row_idx)

    def clear_row(self, row_idx: int) -> None:
        for block_table in self.block_tables:
            block_table.clear_row(row_idx)

    def move_row(self, src: int, tgt: int) -> None:
        for block_table in self.block_tables:
            block_table.move_row(src, tgt)

    def swap_row(self, src: int, tgt: int) -> None:
        for block_table in self.block_tables:
            block_table.swap_row(src, tgt)

    def compute_slot_mapping(
        self, req_indices: np.ndarray, positions: np.ndarray
    ) -> list[torch.Tensor]:
        """Each group's slot mapping of the batch's tokens (its own blocks, same positions)."""
        return [bt.compute_slot_mapping(req_indices, positions) for bt in self.block_tables]

    def __getitem__(self, idx: int) -> BlockTable:
        """The BlockTable of the idx-th KV cache group."""
        return self.block_tables[idx]

    def __len__(self) -> int:
        return len(self.block_tables)
