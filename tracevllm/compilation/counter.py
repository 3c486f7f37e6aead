"""Counts of what the compiler did in this process, for tests and logs.

Mirrors vllm/compilation/counter.py (``CompilationCounter``,
``compilation_counter``, ``expect``), with the counters tracevllm's path
moves; left out: the AOT-compile counts.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@dataclasses.dataclass
class CompilationCounter:
    num_models_seen: int = 0
    # Dynamo handed a whole graph to VllmBackend.
    num_graphs_seen: int = 0
    # Pieces after the split, the splitting ops' own pieces included.
    num_piecewise_graphs_seen: int = 0
    # The pieces compiled (the splitting ops' pieces left out).
    num_piecewise_capturable_graphs_seen: int = 0
    # CompilerManager.compile calls (one per piece and shape, hit or miss).
    num_backend_compilations: int = 0
    # Inductor actually ran (a cache miss).
    num_inductor_compiles: int = 0
    num_eager_compiles: int = 0
    num_cache_entries_updated: int = 0
    num_compiled_artifacts_saved: int = 0
    num_compiled_artifacts_loaded: int = 0
    stock_torch_compile_count: int = 0
    # CUDA graphs captured: one per compiled piece per capture size.
    num_cudagraph_captured: int = 0
    # tracevllm: graphs replayed (vLLM counts only the captures).
    num_cudagraph_replayed: int = 0

    def clone(self) -> CompilationCounter:
        return copy.deepcopy(self)

    @contextmanager
    def expect(self, **kwargs: Any) -> Iterator[None]:
        """Assert that each named counter moved by exactly this much inside the block."""
        old = self.clone()
        yield
        for k, v in kwargs.items():
            assert getattr(self, k) - getattr(old, k) == v, (
                f"{k} not as expected, before it is {getattr(old, k)}, "
                f"after it is {getattr(self, k)}, expected diff is {v}"
            )


compilation_counter = CompilationCounter()
