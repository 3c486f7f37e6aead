"""The torch.compile backend: split Dynamo's graph at attention, compile each piece.

Mirrors vllm/compilation/backends.py (``split_graph``, ``CompilerManager``,
``PiecewiseCompileInterpreter``, ``VllmBackend``). Dynamo hands
``VllmBackend`` the whole forward as one FX graph; ``split_graph`` cuts it
at every splitting op (the attention ops), so a 2-layer model gives five
pieces: three compiled ones (embedding .. layer 0's QKV and RoPE; layer 0's
o_proj, MLP .. layer 1's RoPE; layer 1's o_proj, MLP, final norm) and two
splitting ones that run the attention ops as plain Python between them.
Each compiled piece goes to ``PiecewiseBackend``, which asks
``CompilerManager`` for it per shape; the manager loads it from the cache
directory when a previous start saved it (a hit: no Inductor), else
compiles and saves it. With PIECEWISE CUDA graphs each compiled piece is
wrapped in a ``CUDAGraphWrapper`` (``wrap_with_cudagraph_if_needed``).
Left out: post-grad passes (fusions), Inductor graph partition, the
generated stitching code (tracevllm runs the split GraphModule itself), the
AOT "mega artifact".
"""

from __future__ import annotations

import ast
import inspect
import operator
import os
import pprint
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
import torch.fx.passes.split_module

from tracevllm import tracing
from tracevllm.compilation.caching import compute_cache_hash, compute_code_hash, local_cache_dir
from tracevllm.compilation.compiler_interface import (
    CompilerInterface,
    EagerAdaptor,
    InductorStandaloneAdaptor,
)
from tracevllm.compilation.counter import compilation_counter
from tracevllm.compilation.piecewise_backend import PiecewiseBackend
from tracevllm.tracing import compilation as records

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tracevllm.config import VllmConfig


_SPLIT_MODULE_TUPLE_RETURN = (
    "tuple_return" in inspect.signature(torch.fx.passes.split_module.split_module).parameters
)


def make_compiler(backend: str) -> CompilerInterface:
    return EagerAdaptor() if backend == "eager" else InductorStandaloneAdaptor()


class CompilerManager:
    """Compiles pieces, or loads them from ``vllm_compile_cache.py`` in the cache directory.

    The cache maps ``(runtime_shape, graph_index, compiler_name)`` to the
    compiler's handle (a file name), written as a Python literal for
    readability (vLLM's choice; ``None`` is the general shape).
    """

    def __init__(self, backend: str) -> None:
        self.cache: dict[tuple[int | None, int, str], Any] = {}
        self.is_cache_updated = False
        self.compiler = make_compiler(backend)

    def compute_hash(self) -> str:
        return self.compiler.compute_hash()

    def initialize_cache(self, cache_dir: str, disable_cache: bool = False) -> None:
        self.disable_cache = disable_cache
        self.cache_file_path = os.path.join(cache_dir, "vllm_compile_cache.py")
        if not disable_cache and os.path.exists(self.cache_file_path):
            with open(self.cache_file_path) as f:
                self.cache = ast.literal_eval(f.read())  # literals only, never eval()
        self.compiler.initialize_cache(cache_dir, disable_cache)

    def save_to_file(self) -> None:
        if self.disable_cache or not self.is_cache_updated:
            return
        tmp = f"{self.cache_file_path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(pprint.pformat(self.cache, indent=4))
        os.replace(tmp, self.cache_file_path)  # a reader never sees half a file

    def load(self, graph: fx.GraphModule, graph_index: int, runtime_shape: int | None) -> Any:
        handle = self.cache.get((runtime_shape, graph_index, self.compiler.name))
        if handle is None:
            return None
        try:
            return self.compiler.load(handle, graph)
        except Exception:
            return None  # a missing or stale artifact: compile again and overwrite it

    @tracing.instrument("CompilerManager.compile", record=records.compile_piece)
    def compile(
        self,
        graph: fx.GraphModule,
        example_inputs: list[Any],
        additional_inductor_config: dict[str, Any],
        runtime_shape: int | None = None,
        graph_index: int = 0,
        num_graphs: int = 1,
        fake_mode: FakeTensorMode | None = None,
    ) -> Any:
        """One piece for one shape: from the cache if it is there, else compiled and saved."""
        compilation_counter.num_backend_compilations += 1
        start = time.perf_counter()
        compiled = self.load(graph, graph_index, runtime_shape)
        self.last_hit = compiled is not None
        if compiled is None:
            shape = "general" if runtime_shape is None else f"shape_{runtime_shape}"
            key = f"artifact_{shape}_subgraph_{graph_index}"
            context: Any = fake_mode if fake_mode is not None else _nullcontext()
            with context:
                compiled, handle = self.compiler.compile(
                    graph, example_inputs, additional_inductor_config, runtime_shape, key
                )
            if handle is not None:
                self.cache[(runtime_shape, graph_index, self.compiler.name)] = handle
                compilation_counter.num_cache_entries_updated += 1
                self.is_cache_updated = True
        self.last_ms = (time.perf_counter() - start) * 1e3
        return compiled


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@dataclass
class SplitItem:
    submod_name: str
    graph_id: int
    is_splitting_graph: bool
    graph: fx.GraphModule


def should_split(node: fx.Node, splitting_ops: list[str]) -> bool:
    """Is ``node`` a call of one of ``splitting_ops`` ("ns::name" or "ns::name.overload")?"""
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name in splitting_ops
    if isinstance(target, torch._ops.OpOverload):
        packet = target.name()
        return packet in splitting_ops or f"{packet}.{target._overloadname}" in splitting_ops
    return False


# --8<-- [start:split_graph]
def split_graph(
    graph: fx.GraphModule, splitting_ops: list[str]
) -> tuple[fx.GraphModule, list[SplitItem]]:
    """Cut ``graph`` before and after every run of splitting ops.

    Each node gets a subgraph id: ids go up by one at a splitting op and
    again after it, so the ops between two attentions share an id, and two
    splitting ops in a row (the KV write, then the attention) share one.
    ``split_module`` turns each id into a submodule ``submod_<id>``, keeping
    the nodes in their order (the ops mutate their ``output`` argument, so
    order is meaning).
    """
    subgraph_id = 0
    node_to_subgraph_id: dict[fx.Node, int] = {}
    split_op_graphs: list[int] = []
    for node in graph.graph.nodes:
        if node.op in ("output", "placeholder"):
            continue
        # A getitem stays with the node it reads from (no tuple crosses a cut).
        if node.op == "call_function" and node.target == operator.getitem:
            source = node.args[0]
            if isinstance(source, fx.Node) and source.op != "placeholder":
                node_to_subgraph_id[node] = node_to_subgraph_id[source]
                continue
        if should_split(node, splitting_ops):
            subgraph_id += 1
            node_to_subgraph_id[node] = subgraph_id
            split_op_graphs.append(subgraph_id)
            # The next splitting op joins this piece; anything else starts a new one.
            if should_split(node.next, splitting_ops):
                subgraph_id -= 1
            else:
                subgraph_id += 1
        else:
            node_to_subgraph_id[node] = subgraph_id

    # torch >= 2.12 can make every piece return a tuple; before, a piece with one
    # output returns it bare (PiecewiseBackend's returns_tuple copes with both).
    split_module = torch.fx.passes.split_module.split_module
    tuple_return: dict[str, Any] = {"tuple_return": True} if _SPLIT_MODULE_TUPLE_RETURN else {}
    split_gm = split_module(
        graph,
        None,  # type: ignore[arg-type]
        lambda node: node_to_subgraph_id[node],
        keep_original_order=True,
        **tuple_return,
    )
    items = []
    for name, module in split_gm.named_children():
        graph_id = int(name.replace("submod_", ""))
        assert isinstance(module, fx.GraphModule)
        items.append(SplitItem(name, graph_id, graph_id in split_op_graphs, module))
    items.sort(key=lambda x: x.graph_id)
    return split_gm, items


# --8<-- [end:split_graph]


def wrap_with_cudagraph_if_needed(
    piecewise_backend: PiecewiseBackend, vllm_config: VllmConfig, is_first_graph: bool
) -> Any:
    """A compiled piece in a ``CUDAGraphWrapper`` when PIECEWISE graphs are on."""
    cudagraph_mode = vllm_config.compilation_config.cudagraph_mode
    if cudagraph_mode is None or not cudagraph_mode.has_piecewise_cudagraphs():
        return piecewise_backend
    from tracevllm.compilation.config import CUDAGraphMode
    from tracevllm.compilation.cuda_graph import CUDAGraphOptions, CUDAGraphWrapper

    return CUDAGraphWrapper(
        piecewise_backend,
        CUDAGraphMode.PIECEWISE,
        CUDAGraphOptions(debug_log_enable=is_first_graph, gc_disable=not is_first_graph),
    )


class PiecewiseCompileInterpreter(torch.fx.Interpreter):  # type: ignore[misc]
    """Runs the split graph on fake inputs; each compiled piece it meets is
    replaced by a ``PiecewiseBackend`` (compiled there and then), with the
    piece's fake inputs as examples, so each piece sees the shapes it will get."""

    def __init__(
        self,
        module: fx.GraphModule,
        compile_submod_names: list[str],
        vllm_config: VllmConfig,
        vllm_backend: VllmBackend,
    ) -> None:
        super().__init__(module)
        self.compile_submod_names = compile_submod_names
        self.vllm_config = vllm_config
        self.vllm_backend = vllm_backend
        self.extra_traceback = False

    def call_module(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        assert isinstance(target, str)
        gm = getattr(self.module, target)
        output = fx.map_arg(gm.graph.output_node().args[0], lambda n: n.meta["example_value"])
        if target in self.compile_submod_names:
            from torch._inductor.compile_fx import graph_returns_tuple

            sym_shape_indices = [i for i, x in enumerate(args) if isinstance(x, torch.SymInt)]
            index = self.compile_submod_names.index(target)
            piecewise_backend = PiecewiseBackend(
                gm,
                self.vllm_config,
                index,
                len(self.compile_submod_names),
                sym_shape_indices,
                self.vllm_backend,
                graph_returns_tuple(gm),
                submod_name=target,
            )
            self.module.__dict__[target] = wrap_with_cudagraph_if_needed(
                piecewise_backend, self.vllm_config, is_first_graph=index == 0
            )
            compilation_counter.num_piecewise_capturable_graphs_seen += 1
        return output


class VllmBackend:
    """The ``backend=`` of torch.compile for VLLM_COMPILE: called once, with
    Dynamo's whole graph; returns the callable that runs the split pieces."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "backbone") -> None:
        self.vllm_config = vllm_config
        self.compilation_config = vllm_config.compilation_config
        self.prefix = prefix
        self.compiler_manager = CompilerManager(self.compilation_config.backend)
        self.inductor_config = dict(self.compilation_config.inductor_compile_config)
        self._called = False
        self.dynamo_start_ns = time.time_ns()  # set again by the decorator as Dynamo starts
        self.cache_hit = False

    def __call__(self, graph: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        assert not self._called, "VllmBackend can only be called once"
        self._called = True
        compilation_counter.num_graphs_seen += 1
        # Dynamo's part ends here: it has captured the forward as one graph.
        end_ns = time.time_ns()
        self.dynamo_ms = (end_ns - self.dynamo_start_ns) / 1e6
        records.record_span(
            "dynamo_capture",
            self.dynamo_start_ns,
            end_ns,
            {"tracevllm.compile.graph_nodes": len(graph.graph.nodes)},
        )
        return self.split_and_compile(graph, example_inputs)

    @tracing.instrument("VllmBackend.split_and_compile", record=records.vllm_backend_call)
    def split_and_compile(
        self, graph: fx.GraphModule, example_inputs: Sequence[Any]
    ) -> Callable[..., Any]:
        """The cache directory, the split, every piece compiled (or loaded)."""

        code_hash = compute_code_hash(self.compilation_config.traced_files)
        self.compilation_config.traced_files.clear()
        hash_key = compute_cache_hash(
            self.vllm_config, self.compiler_manager.compute_hash(), code_hash
        )
        cache_dir = local_cache_dir(self.vllm_config, hash_key, self.prefix)
        os.makedirs(cache_dir, exist_ok=True)
        # A saved piece holds Inductor's generated C++, not the built library:
        # Inductor's own cache (its .so files) goes beside it, or a cached
        # start builds every kernel again (measured: 101 s of 105 on the tiny
        # model). vLLM does the same for its AOT artifacts; set unconditionally
        # as vLLM, since torch may have filled in its /tmp default already.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
            self.compilation_config.cache_dir, "inductor_cache"
        )
        self.compilation_config.local_cache_dir = cache_dir
        self.compiler_manager.initialize_cache(cache_dir)

        self.graph = graph
        splitting_ops = self.compilation_config.splitting_ops or []
        self.split_gm, self.piecewise_graphs = split_graph(graph, splitting_ops)
        compilation_counter.num_piecewise_graphs_seen += len(self.piecewise_graphs)
        compile_names = [p.submod_name for p in self.piecewise_graphs if not p.is_splitting_graph]

        # The pieces are compiled on the graph's own fake inputs (symbolic num_tokens).
        fake_args = [
            node.meta["example_value"] if isinstance(real, torch.Tensor) else real
            for node, real in zip(graph.graph.find_nodes(op="placeholder"), example_inputs)
        ]
        compiled_before = compilation_counter.num_inductor_compiles
        start = time.perf_counter()
        PiecewiseCompileInterpreter(self.split_gm, compile_names, self.vllm_config, self).run(
            *fake_args
        )
        self.compile_ms = (time.perf_counter() - start) * 1e3
        self.cache_hit = compilation_counter.num_inductor_compiles == compiled_before
        self.compiler_manager.save_to_file()
        self._write_graph(cache_dir)
        return self.split_gm  # type: ignore[no-any-return]

    def _write_graph(self, cache_dir: str) -> None:
        """``computation_graph.py``: the split graph as code, for a reader (as vLLM)."""
        path = os.path.join(cache_dir, "computation_graph.py")
        if not os.path.exists(path):
            src = self.split_gm.print_readable(print_output=False)
            with open(path, "w") as f:
                f.write("from __future__ import annotations\nimport torch\n" + src)
