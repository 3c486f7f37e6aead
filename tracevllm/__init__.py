"""tracevllm: vLLM's V1 engine, small enough to read, instrumented to watch.

The public names are vLLM's: ``LLM``, ``SamplingParams``, ``RequestOutput``,
``CompletionOutput``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tracevllm import logger as _logger  # noqa: F401  (the "tracevllm" logger's handler)

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineArgs"]

if TYPE_CHECKING:
    from tracevllm.engine.arg_utils import EngineArgs
    from tracevllm.entrypoints.llm import LLM
    from tracevllm.outputs import CompletionOutput, RequestOutput
    from tracevllm.sampling_params import SamplingParams

_LAZY = {
    "LLM": "tracevllm.entrypoints.llm",
    "SamplingParams": "tracevllm.sampling_params",
    "RequestOutput": "tracevllm.outputs",
    "CompletionOutput": "tracevllm.outputs",
    "EngineArgs": "tracevllm.engine.arg_utils",
}


def __getattr__(name: str) -> Any:
    # Lazy, so that `import tracevllm` stays cheap (the engine process imports
    # torch; the frontend need not).
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tracevllm' has no attribute {name!r}")
