"""What the compile spans show: Dynamo's capture, the split, each piece's compile.

The compiler's methods (compilation/backends.py) carry ``tracing.instrument``;
the ``record`` functions here put what they did on their spans, so the
compiler holds no tracing code. One compile reads, as a tree:

    TorchCompileWithNoGuardsWrapper.compile   (the first call of the model)
      dynamo_capture                          (Dynamo turning forward() into a graph)
      VllmBackend.split_and_compile           (split into N pieces; cache dir, hit or miss)
        CompilerManager.compile  x pieces     (graph index, shape, cache hit, ms)

vLLM records the same events as "Dynamo bytecode transform", "Inductor
compilation" and "Compile graph" spans (vllm/compilation/backends.py).
"""

from __future__ import annotations

import time
from typing import Any

from tracevllm import tracing


def compile_piece(
    span: Any, result: Any, manager: Any, graph: Any, *args: Any, **kwargs: Any
) -> None:
    """CompilerManager.compile: which piece, for which shape, from the cache or not."""
    runtime_shape = kwargs.get("runtime_shape")
    span.set_attributes(
        {
            "tracevllm.compile.graph_index": kwargs.get("graph_index", 0),
            "tracevllm.compile.num_graphs": kwargs.get("num_graphs", 1),
            "tracevllm.compile.runtime_shape": (
                "general" if runtime_shape is None else int(runtime_shape)
            ),
            "tracevllm.compile.compiler": manager.compiler.name,
            "tracevllm.compile.cache_hit": bool(manager.last_hit),
            "tracevllm.compile.ms": round(manager.last_ms, 3),
            "tracevllm.compile.graph_nodes": len(graph.graph.nodes),
        }
    )


def vllm_backend_call(span: Any, result: Any, backend: Any, *args: Any, **kwargs: Any) -> None:
    """VllmBackend.split_and_compile: the split and the cache."""
    pieces = backend.piecewise_graphs
    span.set_attributes(
        {
            "tracevllm.compile.dynamo_ms": round(backend.dynamo_ms, 3),
            "tracevllm.compile.graph_nodes": len(backend.graph.graph.nodes),
            "tracevllm.compile.num_pieces": len(pieces),
            "tracevllm.compile.num_compiled_pieces": sum(not p.is_splitting_graph for p in pieces),
            "tracevllm.compile.splitting_ops": list(backend.compilation_config.splitting_ops or []),
            "tracevllm.compile.compile_sizes": list(backend.compilation_config.compile_sizes or []),
            "tracevllm.compile.cache_dir": backend.compilation_config.local_cache_dir,
            "tracevllm.compile.cache_hit": bool(backend.cache_hit),
            "tracevllm.compile.pieces_ms": round(backend.compile_ms, 3),
        }
    )


def record_span(name: str, start_ns: int, end_ns: int, attributes: dict[str, Any]) -> None:
    """A span for something already done between two ``time.time_ns()`` stamps
    (Dynamo's capture, which has no method of ours to wrap)."""
    if not tracing.is_enabled():
        return
    span = tracing.get_tracer().start_span(name, attributes=attributes, start_time=start_ns)
    span.end(end_time=end_ns)


def now_ns() -> int:
    return time.time_ns()
