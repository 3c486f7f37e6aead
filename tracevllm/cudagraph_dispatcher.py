"""Which CUDA graph a step runs: the padded size, or none.

Mirrors vllm/v1/cudagraph_dispatcher.py (``CudagraphDispatcher``: the keys
captured, ``dispatch``, ``get_capture_descs``). PIECEWISE keys only: one
per capture size, for any mix of requests (a graph of the pieces between
attentions does not care how the tokens split into requests). Left out:
FULL keys (uniform decode batches), LoRA counts.

E.g. capture sizes [1, 2, 4, 8, 16]: a step of 5 tokens runs the graph of
8 (three padding tokens, which attention ignores), one of 17 runs without
graphs.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

from tracevllm.compilation.config import CUDAGraphMode
from tracevllm.forward_context import BatchDescriptor

if TYPE_CHECKING:
    from tracevllm.config import VllmConfig


class CudagraphDispatcher:
    def __init__(self, vllm_config: VllmConfig) -> None:
        self.compilation_config = vllm_config.compilation_config
        self.cudagraph_keys: dict[CUDAGraphMode, set[BatchDescriptor]] = {
            CUDAGraphMode.PIECEWISE: set(),
            CUDAGraphMode.FULL: set(),
        }
        self.keys_initialized = False
        self.cudagraph_mode = CUDAGraphMode.NONE
        self.capture_sizes: list[int] = []

    def initialize_cudagraph_keys(self, cudagraph_mode: CUDAGraphMode) -> None:
        """One PIECEWISE key per capture size (vLLM: after the attention backend
        said which modes it supports)."""
        self.cudagraph_mode = cudagraph_mode
        if cudagraph_mode.has_piecewise_cudagraphs():
            self.capture_sizes = sorted(self.compilation_config.cudagraph_capture_sizes or [])
            for size in self.capture_sizes:
                self.cudagraph_keys[CUDAGraphMode.PIECEWISE].add(BatchDescriptor(size))
        self.keys_initialized = True

    def padded_num_tokens(self, num_tokens: int) -> int | None:
        """The smallest capture size >= num_tokens; None above the largest."""
        i = bisect.bisect_left(self.capture_sizes, num_tokens)
        return self.capture_sizes[i] if i < len(self.capture_sizes) else None

    # --8<-- [start:dispatch]
    def dispatch(self, num_tokens: int) -> tuple[CUDAGraphMode, BatchDescriptor]:
        """(the runtime mode, the batch it runs as): PIECEWISE and the padded
        size when one was captured, else NONE and the step's own size."""
        if not self.keys_initialized or self.cudagraph_mode == CUDAGraphMode.NONE:
            return CUDAGraphMode.NONE, BatchDescriptor(num_tokens)
        padded = self.padded_num_tokens(num_tokens)
        if padded is not None:
            descriptor = BatchDescriptor(padded)
            if descriptor in self.cudagraph_keys[CUDAGraphMode.PIECEWISE]:
                return CUDAGraphMode.PIECEWISE, descriptor
        return CUDAGraphMode.NONE, BatchDescriptor(num_tokens)

    # --8<-- [end:dispatch]

    def get_capture_descs(self) -> list[tuple[CUDAGraphMode, list[BatchDescriptor]]]:
        """What capture_model captures: largest first, so the smaller graphs
        fit in the memory the larger ones' temporaries freed."""
        result = []
        for mode in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL):
            descs = sorted(self.cudagraph_keys[mode], key=lambda d: d.num_tokens, reverse=True)
            if descs:
                result.append((mode, descs))
        return result
