"""Per-forward state that layers read without it being passed down the call tree.

Mirrors vllm/forward_context.py (``ForwardContext``, ``set_forward_context``,
``get_forward_context``). The model's ``forward(input_ids, positions)`` has no
room for attention metadata, so the runner parks it here for the duration of
one forward and each ``Attention`` layer looks up its own entry by
``layer_name``. The runner also says here whether this forward runs CUDA
graphs (``cudagraph_runtime_mode``) and for which padded batch
(``batch_descriptor``): the graph wrappers around the compiled pieces read
both (compilation/cuda_graph.py). Left out: data-parallel metadata,
micro-batching.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from tracevllm.compilation.config import CUDAGraphMode

if TYPE_CHECKING:
    import torch

    from tracevllm.attention.backends.abstract import AttentionMetadata
    from tracevllm.config import VllmConfig


class BatchDescriptor(NamedTuple):
    """The key a CUDA graph is captured and replayed under (vLLM's, less LoRA).

    ``num_tokens`` is the padded size; PIECEWISE graphs serve any number of
    requests, so ``num_reqs`` is None and ``uniform`` False for them.
    """

    num_tokens: int
    num_reqs: int | None = None
    uniform: bool = False


@dataclass(slots=True)
class ForwardContext:
    # layer_name -> the Attention layer (vLLM copies this from
    # compilation_config.static_forward_context).
    no_compile_layers: dict[str, Any]
    # layer_name -> its attention metadata (one KV cache group: all share one).
    attn_metadata: dict[str, AttentionMetadata] | None
    # layer_name -> slot mapping for the KV cache write.
    slot_mapping: dict[str, torch.Tensor] = field(default_factory=dict)
    # tracevllm: free-form per-step extras (e.g. a tracer for per-layer spans).
    additional_kwargs: dict[str, Any] = field(default_factory=dict)
    # NONE: the pieces run as they are; PIECEWISE: each captures or replays
    # its graph for batch_descriptor.
    cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE
    batch_descriptor: BatchDescriptor | None = None


_forward_context: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    """The context of the forward pass now running."""
    assert _forward_context is not None, (
        "Forward context is not set. Please use `set_forward_context` to set the forward context."
    )
    return _forward_context


def is_forward_context_available() -> bool:
    return _forward_context is not None


@contextmanager
def set_forward_context(
    attn_metadata: dict[str, AttentionMetadata] | None,
    vllm_config: VllmConfig | None = None,
    no_compile_layers: dict[str, Any] | None = None,
    slot_mapping: dict[str, torch.Tensor] | None = None,
    additional_kwargs: dict[str, Any] | None = None,
    cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE,
    batch_descriptor: BatchDescriptor | None = None,
) -> Iterator[ForwardContext]:
    """Install a ForwardContext for one forward pass, and restore the previous one.

    vLLM takes the layers from ``vllm_config.compilation_config``; tracevllm has
    no compilation config, so the runner passes its layers in.
    """
    global _forward_context
    prev = _forward_context
    _forward_context = ForwardContext(
        no_compile_layers=no_compile_layers or {},
        attn_metadata=attn_metadata,
        slot_mapping=slot_mapping or {},
        additional_kwargs=additional_kwargs or {},
        cudagraph_runtime_mode=cudagraph_runtime_mode,
        batch_descriptor=batch_descriptor,
    )
    try:
        yield _forward_context
    finally:
        _forward_context = prev
