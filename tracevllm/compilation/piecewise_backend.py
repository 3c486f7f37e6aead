"""One piece of the split graph, compiled for every shape it will run at.

Mirrors vllm/compilation/piecewise_backend.py (``PiecewiseBackend``,
``create_concrete_args``). A piece between two attentions is compiled once
for a symbolic ``num_tokens`` (the general entry) and once for each of
``compile_sizes`` (an entry specialised to that exact size, where Inductor
can unroll and pick better kernels); ``__call__`` picks the entry by the
runtime ``num_tokens``. Left out: vLLM's compile ranges (tracevllm has one
general entry, vLLM a range up to max_num_batched_tokens), CUDA graph
wrapping, and serialisation of the pieces into one AOT artifact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tracevllm.compilation.backends import VllmBackend
    from tracevllm.config import VllmConfig


def get_fake_args_from_graph(graph: fx.GraphModule) -> list[Any]:
    """The piece's example inputs as Dynamo traced them (fake, symbolic num_tokens)."""
    return [n.meta["example_value"] for n in graph.graph.find_nodes(op="placeholder")]


def create_concrete_args(graph: fx.GraphModule, size: int) -> tuple[list[Any], FakeTensorMode]:
    """Fake inputs with every symbolic dimension set to ``size``, in a fresh fake mode."""
    from torch._prims_common import compute_required_storage_length
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv, is_symbolic

    def concretize(value: Any) -> int:
        if not is_symbolic(value):
            return int(value)
        expr = value.node.expr
        return int(expr.subs({s: size for s in expr.free_symbols}))

    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    args: list[Any] = []
    with fake_mode:
        for value in get_fake_args_from_graph(graph):
            if isinstance(value, torch.SymInt):
                args.append(concretize(value))
            elif isinstance(value, torch.Tensor):
                shape = tuple(concretize(d) for d in value.shape)
                stride = tuple(concretize(s) for s in value.stride())
                offset = concretize(value.storage_offset())
                storage = compute_required_storage_length(shape, stride, offset)
                t = torch.empty(storage, dtype=value.dtype, device=value.device)
                args.append(t.as_strided(shape, stride, offset))
            else:
                args.append(value)
    return args, fake_mode


@dataclass
class RangeEntry:
    """One compiled version of the piece: for ``runtime_shape`` tokens, or any (None)."""

    runtime_shape: int | None
    runnable: Callable[..., Any] | None = None


class PiecewiseBackend:
    def __init__(
        self,
        graph: fx.GraphModule,
        vllm_config: VllmConfig,
        piecewise_compile_index: int,
        total_piecewise_compiles: int,
        sym_shape_indices: list[int],
        vllm_backend: VllmBackend,
        returns_tuple: bool,
        submod_name: str = "",
    ) -> None:
        """Compile ``graph`` for the general shape and each compile size, now."""
        self.graph = graph
        self.compilation_config = vllm_config.compilation_config
        self.piecewise_compile_index = piecewise_compile_index
        self.total_piecewise_compiles = total_piecewise_compiles
        self.is_first_graph = piecewise_compile_index == 0
        self.is_last_graph = piecewise_compile_index == total_piecewise_compiles - 1
        self.vllm_backend = vllm_backend
        self.returns_tuple = returns_tuple
        self.submod_name = submod_name
        self.sym_shape_indices = sym_shape_indices
        # A piece that takes no size as input still knows num_tokens from a
        # tensor's first dimension (tracevllm's fallback; vLLM asserts one entry).
        fake_args = get_fake_args_from_graph(graph)
        self.sym_tensor_index = next(
            (
                i
                for i, x in enumerate(fake_args)
                if isinstance(x, torch.Tensor)
                and x.dim() > 0
                and isinstance(x.shape[0], torch.SymInt)
            ),
            None,
        )
        self.compile_sizes: list[int] = list(self.compilation_config.compile_sizes or [])
        self.general = RangeEntry(runtime_shape=None)
        self.concrete = {size: RangeEntry(runtime_shape=size) for size in self.compile_sizes}
        self.compile_all_ranges()

    def compile_all_ranges(self) -> None:
        manager = self.vllm_backend.compiler_manager
        for entry in [self.general, *self.concrete.values()]:
            fake_mode = None
            if entry.runtime_shape is None:
                args = get_fake_args_from_graph(self.graph)
            else:
                args, fake_mode = create_concrete_args(self.graph, entry.runtime_shape)
            entry.runnable = manager.compile(
                self.graph,
                args,
                self.vllm_backend.inductor_config,
                runtime_shape=entry.runtime_shape,
                graph_index=self.piecewise_compile_index,
                num_graphs=self.total_piecewise_compiles,
                fake_mode=fake_mode,
            )

    def runtime_shape(self, args: tuple[Any, ...]) -> int | None:
        if self.sym_shape_indices:
            return int(args[self.sym_shape_indices[0]])
        if self.sym_tensor_index is not None:
            return int(args[self.sym_tensor_index].shape[0])
        return None

    def __call__(self, *args: Any) -> Any:
        entry = self.concrete.get(self.runtime_shape(args)) or self.general  # type: ignore[arg-type]
        assert entry.runnable is not None, "compiled in __init__"
        output = entry.runnable(*args)
        if self.returns_tuple or not isinstance(output, (tuple, list)):
            return output
        return output[0]
