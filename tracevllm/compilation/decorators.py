"""``@support_torch_compile``: a model class whose forward compiles on its first call.

Mirrors vllm/compilation/decorators.py (``support_torch_compile``,
``_support_torch_compile``, ``ignore_torch_compile``). The decorator adds
``TorchCompileWithNoGuardsWrapper`` to the class's bases and replaces
``__call__``: in mode NONE (or STOCK_TORCH_COMPILE in vLLM, where the
runner compiles) the model runs as written; otherwise the first call marks
``num_tokens`` (dim 0 of ``input_ids`` and ``positions``) dynamic, records
every file Dynamo inlines (they enter the cache key), and compiles; later
calls run the compiled code. The model runner makes that first call at
start-up with ``max_num_batched_tokens`` dummy tokens
(``ModelRunner._dummy_run``), so no request waits for it. Left out: the AOT
compile path and its loading, ``enable_if``, ``mark_unbacked_dims``,
``shape_invariants``, encoder modules.
"""

from __future__ import annotations

import inspect
import time
from typing import Any, TypeVar
from unittest.mock import patch

import torch
from torch import nn

from tracevllm import tracing
from tracevllm.compilation.config import CompilationMode
from tracevllm.compilation.counter import compilation_counter
from tracevllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper
from tracevllm.config import VllmConfig, get_current_vllm_config
from tracevllm.sequence import IntermediateTensors

_T = TypeVar("_T", bound=nn.Module)
DynamicArgDims = dict[str, int | list[int] | dict[int, str]]
IGNORE_COMPILE_KEY = "_ignore_compile_vllm"


def ignore_torch_compile(cls: type[_T]) -> type[_T]:
    """A subclass of a decorated class that should run eagerly."""
    setattr(cls, IGNORE_COMPILE_KEY, True)
    return cls


def support_torch_compile(
    cls: type[_T] | None = None, *, dynamic_arg_dims: DynamicArgDims | None = None
) -> Any:
    """Decorate a model class (``@support_torch_compile`` or with ``dynamic_arg_dims``).

    ``dynamic_arg_dims`` maps forward's argument names to the dimensions
    that vary between calls (an int, a list, or vLLM's ``{dim: shape_id}``;
    tracevllm marks them dynamic and ignores the ids). Without it, every
    argument annotated ``torch.Tensor`` or ``IntermediateTensors`` (possibly
    ``| None``) gets dim 0, as vLLM infers.
    """

    def decorate(cls: type[_T]) -> type[_T]:
        sig = inspect.signature(cls.forward)
        dims = dynamic_arg_dims
        if dims is None:
            # Annotations are strings here (from __future__ import annotations).
            tensor_types = ("torch.Tensor", "IntermediateTensors")
            dims = {
                k: 0
                for k, p in sig.parameters.items()
                if any(str(p.annotation).startswith(t) for t in tensor_types)
            }
        if not dims:
            raise ValueError(f"No dynamic dimensions found in the forward method of {cls}.")
        for k in dims:
            if k not in sig.parameters:
                raise ValueError(f"Argument {k} not found in the forward method of {cls}")
        return _support_torch_compile(cls, dims)

    return decorate(cls) if cls is not None else decorate


def _support_torch_compile(cls: type[_T], dynamic_arg_dims: DynamicArgDims) -> type[_T]:
    if TorchCompileWithNoGuardsWrapper in cls.__bases__:
        return cls  # decorated twice (a subclass decorated like its base)
    cls.__bases__ = cls.__bases__ + (TorchCompileWithNoGuardsWrapper,)
    setattr(cls, IGNORE_COMPILE_KEY, False)
    old_init = cls.__init__

    def __init__(
        self: Any, *args: Any, vllm_config: VllmConfig | None = None, **kwargs: Any
    ) -> None:
        vllm_config = vllm_config or get_current_vllm_config()
        assert vllm_config is not None, "a compiled model is built under set_current_vllm_config"
        old_init(self, *args, vllm_config=vllm_config, **kwargs)
        if "do_not_compile" in self.__dict__:
            return  # a decorated base's __init__ (Qwen3Model's Qwen2Model) did it
        self.vllm_config = vllm_config
        self.compilation_config = vllm_config.compilation_config
        mode = self.compilation_config.mode
        self.do_not_compile = mode in (None, CompilationMode.NONE) or getattr(
            self.__class__, IGNORE_COMPILE_KEY, False
        )
        if self.do_not_compile:
            return
        if mode == CompilationMode.STOCK_TORCH_COMPILE:
            compilation_counter.stock_torch_compile_count += 1
        compilation_counter.num_models_seen += 1
        self.compiled = False
        TorchCompileWithNoGuardsWrapper.__init__(self)

    cls.__init__ = __init__  # type: ignore[method-assign]

    def _mark_dynamic_inputs(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = inspect.signature(self.__class__.forward).bind(self, *args, **kwargs)
        bound.apply_defaults()
        for name, dims in dynamic_arg_dims.items():
            arg = bound.arguments.get(name)
            if arg is None:
                continue
            wanted = list(dims) if isinstance(dims, (dict, list)) else [dims]
            tensors = arg.tensors.values() if isinstance(arg, IntermediateTensors) else [arg]
            for t in tensors:
                if not isinstance(t, torch.Tensor):
                    raise ValueError(f"Unsupported dynamic dimensions for argument {name}.")
                marked = [t.ndim + d if d < 0 else d for d in wanted]
                if any(t.shape[d] < 2 for d in marked):
                    # Dynamo treats sizes 0 and 1 as constants: a graph captured
                    # at one token would hold for one token only.
                    raise ValueError(
                        f"The first call of a compiled {type(self).__name__} needs at least "
                        f"2 tokens in {name} (got shape {tuple(t.shape)})."
                    )
                torch._dynamo.mark_dynamic(t, marked)

    # --8<-- [start:support_torch_compile_call]
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.do_not_compile or torch.compiler.is_compiling():
            return self.forward(*args, **kwargs)
        if self.compiled:
            return TorchCompileWithNoGuardsWrapper.__call__(self, *args, **kwargs)
        from torch._dynamo.symbolic_convert import InliningInstructionTranslator

        _mark_dynamic_inputs(self, *args, **kwargs)
        # The files Dynamo reads the model from go into the cache key: the
        # forward's own, and each function it inlines.
        traced_files = self.compilation_config.traced_files
        traced_files.add(self.original_code_object().co_filename)
        inline_call = InliningInstructionTranslator.inline_call_

        def patched_inline_call(self_: Any) -> Any:
            traced_files.add(self_.f_code.co_filename)
            return inline_call(self_)

        backend = getattr(self, "vllm_backend", None)
        if backend is not None:  # it times Dynamo's capture up to its own call
            backend.dynamo_start_ns = time.time_ns()
        with (
            tracing.get_tracer().start_as_current_span(
                "TorchCompileWithNoGuardsWrapper.compile",
                attributes={
                    "tracevllm.compile.model": type(self).__name__,
                    "tracevllm.compile.mode": self.compilation_config.mode.name,
                    "tracevllm.compile.num_tokens": _num_tokens(args, kwargs),
                },
            ),
            patch.object(InliningInstructionTranslator, "inline_call_", patched_inline_call),
        ):
            output = TorchCompileWithNoGuardsWrapper.__call__(self, *args, **kwargs)
        self.compiled = True
        return output

    # --8<-- [end:support_torch_compile_call]

    def original_code_object(self: Any) -> Any:
        return self.__class__.forward.__code__

    cls.__call__ = __call__  # type: ignore[method-assign]
    cls.original_code_object = original_code_object  # type: ignore[attr-defined]
    return cls


def _num_tokens(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    first = args[0] if args else next(iter(kwargs.values()), None)
    return int(first.shape[0]) if isinstance(first, torch.Tensor) else -1
