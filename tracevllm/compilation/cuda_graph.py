"""CUDA graphs around the compiled pieces: capture once per batch size, then replay.

Mirrors vllm/compilation/cuda_graph.py (``CUDAGraphEntry``,
``CUDAGraphOptions``, ``CUDAGraphWrapper``). A decode step of a small model
on a GPU spends most of its time launching kernels, not running them: each
of a layer's few dozen launches costs the CPU microseconds while the GPU
waits. A CUDA graph records the launches of one call once (capture) and
sends them all again as one (replay), so the CPU cost of a piece becomes one
launch.

A graph replays the same kernels on the same addresses, so it serves one
input size only. The wrapper therefore keeps one graph per
``BatchDescriptor`` (the padded token count), captured the first time the
runner dispatches that size in PIECEWISE mode, which only
``capture_model`` may do, for every size before the first request. It does
not copy inputs, so every tensor a piece takes must be where it was at the
capture: the weights and the RoPE tables are module state (the runner puts
the tables on the device before the first forward, ``move_rope_tables``),
the token ids and positions come from the runner's fixed buffers, and the
rest are earlier pieces' outputs, kept here at the addresses the capture
gave them, or the attention output, which a piece allocated. The wrapper
checks the addresses at each replay and raises if one moved. Attention
runs between the pieces, eagerly, since its metadata (block tables,
sequence lengths) changes every step.

Departure: vLLM keeps each piece's output as a weak reference (a C++ op)
so the pool can reuse it for other sizes' graphs; tracevllm keeps it, which
costs one set of a piece's outputs per piece and captured size (the log of
``capture_model`` says how much) and needs no extension.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any
from unittest.mock import patch

import torch

from tracevllm.compilation.config import CUDAGraphMode
from tracevllm.compilation.counter import compilation_counter
from tracevllm.forward_context import (
    BatchDescriptor,
    get_forward_context,
    is_forward_context_available,
)
from tracevllm.logger import init_logger

logger = init_logger(__name__)

# Captures happen in capture_model only: a capture runs no kernels, so a
# step that captured would return garbage (vLLM's
# validate_cudagraph_capturing_enabled).
_cudagraph_capturing_enabled = False


@contextmanager
def cudagraph_capturing_enabled() -> Iterator[None]:
    global _cudagraph_capturing_enabled
    _cudagraph_capturing_enabled = True
    try:
        yield
    finally:
        _cudagraph_capturing_enabled = False


# One memory pool for every graph of the process (vLLM's platform global pool):
# the pieces of one forward run in order, so their temporaries can share it.
_global_graph_pool: Any = None


def get_global_graph_pool() -> Any:
    global _global_graph_pool
    if _global_graph_pool is None:
        _global_graph_pool = torch.cuda.graph_pool_handle()
    return _global_graph_pool


def _address(x: torch.Tensor) -> int:
    """Where a tensor's data is (an opaque tensor, e.g. oneDNN's packed weights
    on CPU, has no data pointer: the object stands in)."""
    if x.is_mkldnn:
        return id(x)
    return x.data_ptr()


@dataclasses.dataclass
class CUDAGraphEntry:
    batch_descriptor: BatchDescriptor
    cudagraph: torch.cuda.CUDAGraph | None = None
    output: Any | None = None
    # The inputs' addresses at capture, checked at each replay (vLLM checks in
    # debug mode only; a wrong address replays on stale memory, silently).
    input_addresses: list[int] | None = None


@dataclasses.dataclass
class CUDAGraphOptions:
    # Log the capture (the first piece only: a model has dozens).
    debug_log_enable: bool = True
    # Skip the allocator's cache flush before the capture (all pieces but the first).
    gc_disable: bool = False


# --8<-- [start:cuda_graph_wrapper]
class CUDAGraphWrapper:
    """Runs ``runnable`` as it is, or captures / replays its CUDA graph.

    The forward context decides: its ``cudagraph_runtime_mode`` must match
    this wrapper's (PIECEWISE), and its ``batch_descriptor`` picks the graph.
    """

    def __init__(
        self,
        runnable: Callable[..., Any],
        runtime_mode: CUDAGraphMode,
        cudagraph_options: CUDAGraphOptions | None = None,
    ) -> None:
        assert runtime_mode != CUDAGraphMode.NONE, "no wrapper needed without graphs"
        self.runnable = runnable
        self.runtime_mode = runtime_mode
        self.cudagraph_options = cudagraph_options or CUDAGraphOptions()
        self.concrete_cudagraph_entries: dict[BatchDescriptor, CUDAGraphEntry] = {}

    def __getattr__(self, key: str) -> Any:
        # The wrapped piece's attributes (e.g. PiecewiseBackend.graph) show through.
        if key == "runnable":
            raise AttributeError(key)
        return getattr(self.runnable, key)

    def unwrap(self) -> Callable[..., Any]:
        return self.runnable

    def __call__(self, *args: Any) -> Any:
        if not is_forward_context_available():
            return self.runnable(*args)
        ctx = get_forward_context()
        if ctx.cudagraph_runtime_mode != self.runtime_mode:
            # NONE: a warm-up run, a batch larger than any captured size, or eager.
            return self.runnable(*args)
        descriptor = ctx.batch_descriptor
        assert descriptor is not None, "a PIECEWISE forward needs its batch descriptor"
        entry = self.concrete_cudagraph_entries.get(descriptor)
        if entry is None:
            entry = self.concrete_cudagraph_entries[descriptor] = CUDAGraphEntry(descriptor)
        addresses = [_address(x) for x in args if isinstance(x, torch.Tensor)]

        if entry.cudagraph is None:
            if not _cudagraph_capturing_enabled:
                raise RuntimeError(
                    f"No CUDA graph for {descriptor}, and captures happen only in "
                    "ModelRunner.capture_model: the dispatcher chose a size that was not "
                    "captured at start-up."
                )
            if self.cudagraph_options.debug_log_enable:
                logger.debug("Capturing a CUDA graph for %s", descriptor)
            entry.input_addresses = addresses
            cudagraph = torch.cuda.CUDAGraph()
            with ExitStack() as stack:
                if self.cudagraph_options.gc_disable:
                    # torch.cuda.graph empties the allocator's cache (and may
                    # collect garbage) before each capture: once per forward will do.
                    stack.enter_context(patch("gc.collect", lambda *a, **k: 0))
                    stack.enter_context(patch("torch.cuda.empty_cache", lambda: None))
                pool = get_global_graph_pool()
                stack.enter_context(torch.cuda.graph(cudagraph, pool=pool))
                output = self.runnable(*args)
            entry.output = output
            entry.cudagraph = cudagraph
            compilation_counter.num_cudagraph_captured += 1
            return output

        if addresses != entry.input_addresses:
            raise RuntimeError(
                f"CUDA graph for {descriptor}: an input moved since the capture "
                f"(addresses {entry.input_addresses} then, {addresses} now). The runner "
                "must feed the first piece from its fixed buffers."
            )
        entry.cudagraph.replay()
        compilation_counter.num_cudagraph_replayed += 1
        return entry.output


# --8<-- [end:cuda_graph_wrapper]
