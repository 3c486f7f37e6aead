"""torch.compile around a module's forward, with Dynamo's guards dropped.

Mirrors vllm/compilation/wrapper.py (``TorchCompileWithNoGuardsWrapper``).
Dynamo normally re-checks, at every call, the guards it wrote while
capturing (shapes, the values of globals it read, module attributes) and
captures again when one fails. vLLM knows the forward has one graph for
every batch (``num_tokens`` is marked dynamic), so it drops every guard
(``guard_filter_fn``): Dynamo captures once, and each later call goes
straight to the compiled code. STOCK_TORCH_COMPILE keeps the guards.
Left out: the bytecode hook (``VLLM_USE_BYTECODE_HOOK``), AOT compile,
NVTX ranges, guard evaluation for debugging.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from tracevllm import tracing
from tracevllm.compilation.config import CompilationMode

if TYPE_CHECKING:
    from tracevllm.config import VllmConfig

# "Is Dynamo capturing now?", lent to the tracing helpers (False in the compiler
# backend's own code, which is plain Python run during the compile, and traced).
tracing.set_is_compiling(torch.compiler.is_dynamo_compiling)


@contextmanager
def _compilation_context() -> Iterator[None]:
    """vLLM's: room for more cache entries (each engine in a process adds one
    to the forward's code object, as each brings its own backend)."""
    config = torch._dynamo.config
    old = config.cache_size_limit, config.accumulated_cache_size_limit
    config.cache_size_limit, config.accumulated_cache_size_limit = 2048, 8192
    try:
        yield
    finally:
        config.cache_size_limit, config.accumulated_cache_size_limit = old


class TorchCompileWithNoGuardsWrapper:
    """Base added to a ``support_torch_compile`` class: compiles ``self.forward``."""

    vllm_config: VllmConfig
    forward: Callable[..., Any]

    def __init__(self) -> None:
        from tracevllm.compilation.backends import VllmBackend

        compilation_config = self.vllm_config.compilation_config
        if self.vllm_config.device_config.device == "cpu":
            from tracevllm.platforms.cpu import inductor_compile_config

            # The platform's options under the user's, before the cache key is taken.
            compilation_config.inductor_compile_config = {
                **inductor_compile_config(),
                **compilation_config.inductor_compile_config,
            }
        mode = compilation_config.mode
        assert mode not in (None, CompilationMode.NONE), "nothing to compile in mode NONE"
        backend: Any
        options: dict[str, Any] = {}
        if mode == CompilationMode.VLLM_COMPILE:
            backend = self.vllm_backend = VllmBackend(self.vllm_config)
        else:
            # Modes 1 and 2: the whole graph to Inductor (or eager), no split.
            backend = compilation_config.backend or "inductor"
            if backend == "inductor":
                options = dict(compilation_config.inductor_compile_config)
        if mode != CompilationMode.STOCK_TORCH_COMPILE:
            options["guard_filter_fn"] = torch.compiler.skip_all_guards_unsafe
        self._compiled_callable = torch.compile(
            self.forward, fullgraph=True, dynamic=False, backend=backend, options=options
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with _compilation_context():
            return self._compiled_callable(*args, **kwargs)
