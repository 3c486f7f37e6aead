"""Lab 03: the slot mapping. Your version of
``tracevllm.worker.block_table.BlockTable.compute_slot_mapping``.

Read README.md first. Test it with ``make lab CH=03``; watch it place real
tokens in the KV cache with ``TRACEVLLM_LAB=03 make trace PROMPT="..."``.

It is written as a plain function whose first argument is the ``BlockTable``:
the engine installs it as the method.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:  # not at run time: this file is loaded while that module is
    from tracevllm.worker.block_table import BlockTable


def compute_slot_mapping(
    self: BlockTable, req_indices: np.ndarray, positions: np.ndarray
) -> torch.Tensor:
    """Cache slot of every token in the batch: the page table lookup."""
    # req_indices[i]: the block-table row of token i's request.
    # positions[i]:   token i's position in its request (0, 1, 2, ...).
    # TODO 1: the physical block of each token: self.block_table_np[row, logical
    #         block], the logical block being position // self.block_size.
    #         Do it for all tokens at once (numpy fancy indexing), no Python loop.
    # TODO 2: slot = physical block * self.block_size + position % self.block_size,
    #         as int64.
    # TODO 3: write the slots into self.slot_mapping_np[:num_tokens] and set the
    #         rest of that buffer to PAD_SLOT_ID (-1, from
    #         tracevllm.worker.block_table): padding the cache write skips.
    # TODO 4: return self.slot_mapping[:num_tokens] (a torch view of that buffer).
    raise NotImplementedError("Lab 03: compute_slot_mapping (see chapters/03-slot-mapping)")
