"""The compilers a piece of the graph can go to: Inductor (saved to disk) or none.

Mirrors vllm/compilation/compiler_interface.py (``CompilerInterface``,
``InductorStandaloneAdaptor``, ``EagerAdaptor``). Inductor compiles one FX
graph with ``torch._inductor.standalone_compile`` and the artifact is saved
to a file under the cache directory; ``load`` reads it back without running
Inductor. Left out: the older ``InductorAdaptor`` (which hijacks Inductor's
own FX graph cache), AOT artifacts, the atomic-save patch for old torch.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.fx as fx

from tracevllm.compilation.counter import compilation_counter


class CompilerInterface:
    """One compiler: ``compile`` a graph for a shape, ``load`` what it saved."""

    name: str = ""

    def initialize_cache(self, cache_dir: str, disable_cache: bool = False) -> None:
        self.cache_dir = cache_dir
        self.disable_cache = disable_cache

    def compute_hash(self) -> str:
        """What about the compiler changes its output (its version, its config)."""
        return ""

    def compile(
        self,
        graph: fx.GraphModule,
        example_inputs: list[Any],
        compiler_config: dict[str, Any],
        runtime_shape: int | None,
        key: str,
    ) -> tuple[Callable[..., Any], Any]:
        """(callable, handle): the handle goes into the cache file, for ``load``."""
        raise NotImplementedError

    def load(self, handle: Any, graph: fx.GraphModule) -> Callable[..., Any]:
        raise NotImplementedError


def get_inductor_factors() -> list[Any]:
    """vLLM's ``get_inductor_factors``: torch's version and Inductor's config."""
    from torch._inductor import config as inductor_config

    return [torch.__version__, inductor_config.save_config_portable()]


_packed_linear_as_extern = False


def call_packed_linear_as_is() -> None:
    """Have Inductor call ``mkldnn._linear_pointwise`` as it is (an extern kernel).

    tracevllm packs each linear's weight for oneDNN once, at load
    (layers/utils.py), and calls ``mkldnn._linear_pointwise`` on it. Inductor's
    own lowering of that op expects a weight it packed itself (under
    ``freezing``) and fails on ours; called as is, the op runs exactly as in
    eager, which is also how vLLM's compiled CPU path calls its ``onednn_mm``.
    """
    global _packed_linear_as_extern
    if _packed_linear_as_extern:
        return
    import torch._inductor.lowering as lowering

    op = torch.ops.mkldnn._linear_pointwise.default
    lowering.lowerings.pop(op, None)
    lowering.make_fallback(op, warn=False)
    _packed_linear_as_extern = True


class InductorStandaloneAdaptor(CompilerInterface):
    """Inductor through ``standalone_compile``; each artifact a file of its own."""

    name = "inductor_standalone"

    def compute_hash(self) -> str:
        return hashlib.sha256(str(get_inductor_factors()).encode()).hexdigest()[:10]

    def compile(
        self,
        graph: fx.GraphModule,
        example_inputs: list[Any],
        compiler_config: dict[str, Any],
        runtime_shape: int | None,
        key: str,
    ) -> tuple[Callable[..., Any], Any]:
        from torch._inductor import standalone_compile

        compilation_counter.num_inductor_compiles += 1
        call_packed_linear_as_is()
        # A size of its own is compiled for the concrete shape of the example
        # inputs; the general piece keeps the graph's symbolic num_tokens.
        dynamic_shapes: Literal["from_graph", "from_example_inputs"] = (
            "from_graph" if runtime_shape is None else "from_example_inputs"
        )
        # With oneDNN "disabled" while Inductor runs, its post-grad pass does
        # not fuse an add or an activation into the packed linear (the fused
        # op has no shape function for a weight Inductor did not pack).
        # Compilation only: the compiled code calls the op as eager does.
        with torch.backends.mkldnn.flags(enabled=False):
            compiled = standalone_compile(
                graph,
                example_inputs,
                dynamic_shapes=dynamic_shapes,
                options={"config_patches": dict(compiler_config)},
            )
        if self.disable_cache:
            return compiled, None
        path = os.path.join(self.cache_dir, key)
        compiled.save(path=path, format="binary")
        compilation_counter.num_compiled_artifacts_saved += 1
        return compiled, (key, path)

    def load(self, handle: Any, graph: fx.GraphModule) -> Callable[..., Any]:
        _, path = handle
        compiled = torch._inductor.CompiledArtifact.load(path=path, format="binary")
        compilation_counter.num_compiled_artifacts_loaded += 1
        return compiled  # type: ignore[no-any-return]


class EagerAdaptor(CompilerInterface):
    """backend="eager": the piece runs as the FX graph Dynamo captured."""

    name = "eager"

    def compile(
        self,
        graph: fx.GraphModule,
        example_inputs: list[Any],
        compiler_config: dict[str, Any],
        runtime_shape: int | None,
        key: str,
    ) -> tuple[Callable[..., Any], Any]:
        compilation_counter.num_eager_compiles += 1
        return graph, None  # nothing to save: an eager piece costs nothing to remake
