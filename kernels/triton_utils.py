"""``triton`` and ``tl`` for the kernels, or stand-ins when Triton is not installed.

Mirrors vllm/triton_utils/importing.py (``HAS_TRITON``, ``TritonPlaceholder``,
``TritonLanguagePlaceholder``): every kernel file imports ``triton`` and ``tl``
from here, so the plain-PyTorch references beside the kernels keep working on a
machine without Triton (it is an optional extra: ``pip install 'tracevllm[triton]'``).
Left out: vLLM's check of active Triton drivers.

``TRITON_INTERPRET=1`` runs the kernels on the CPU, in Python. Triton reads it
when ``triton`` is first imported (``triton.language`` itself is made of
``@triton.jit`` functions), so it must be set before anything in the process
imports Triton, including torch and transformers, which do.
"""

from __future__ import annotations

import types
from importlib.util import find_spec
from typing import Any

HAS_TRITON = find_spec("triton") is not None

_MISSING = "Triton is not installed: pip install 'tracevllm[triton]' (or triton==3.9.0)."


class _MissingKernel:
    """What ``@triton.jit`` returns without Triton: launching it says what is missing."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __getitem__(self, grid: Any) -> Any:
        raise ImportError(_MISSING)


class _TritonPlaceholder(types.ModuleType):
    def __init__(self) -> None:
        super().__init__("triton")

    def jit(self, fn: Any = None, **kwargs: Any) -> Any:
        if fn is None:  # @triton.jit(...) with arguments
            return _MissingKernel
        return _MissingKernel(fn)

    def __getattr__(self, name: str) -> Any:
        raise ImportError(_MISSING)


class _TritonLanguagePlaceholder(types.ModuleType):
    # Kernel signatures name tl.constexpr only in annotations, which
    # ``from __future__ import annotations`` leaves as strings: nothing else
    # of ``tl`` is touched until a kernel runs.
    def __init__(self) -> None:
        super().__init__("triton.language")

    def __getattr__(self, name: str) -> Any:
        raise ImportError(_MISSING)


if HAS_TRITON:
    import triton
    import triton.language as tl
else:
    triton = _TritonPlaceholder()
    tl = _TritonLanguagePlaceholder()


def interpreter_active() -> bool:
    """True when the kernels will run in Triton's CPU interpreter.

    The switch must have been on when Triton was imported: ``triton.language``'s
    own helpers (``tl.zeros``, ``tl.sum``, ...) are jitted then, for the GPU or
    for the interpreter, once.
    """
    if not HAS_TRITON:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.zeros, InterpretedFunction)


__all__ = ["HAS_TRITON", "interpreter_active", "tl", "triton"]
