"""``triton`` and ``tl`` for the kernels: imported at their first use, or
stand-ins when Triton is not installed.

Mirrors vllm/triton_utils/importing.py (``HAS_TRITON``, ``TritonPlaceholder``,
``TritonLanguagePlaceholder``): every kernel file imports ``triton`` and ``tl``
from here, so the plain-PyTorch references beside the kernels keep working on a
machine without Triton (it is an optional extra: ``pip install 'tracevllm[triton]'``).
Left out: vLLM's check of active Triton drivers.

Departure: vLLM imports Triton with the module. Here Triton is imported only
when a Triton path is taken (a kernel launched, ``triton.cdiv`` called,
``interpreter_active()`` asked), never for the torch backend, which imports
the same kernel files for their ``*_torch`` references. Importing Triton
loads its compiler (a second or so), and kernels made (``JITFunction``) and
never launched leave its nanobind extension printing some fifty lines of
"leaked functions" at the exit of an in-process script. So until a first
use ``@triton.jit`` gives a ``_DeferredKernel``, even when something else
imported Triton already (torch's compiler does, and transformers imports
that); the first use swaps the real ``JITFunction`` (and the real ``triton``
and ``tl``) into every kernel module's globals, where Triton's compiler and
its interpreter look them up.

``TRITON_INTERPRET=1`` runs the kernels on the CPU, in Python. Triton reads it
when ``triton`` is first imported (``triton.language`` itself is made of
``@triton.jit`` functions), so it must be set before anything in the process
imports Triton, including torch's compiler, which does.
"""

from __future__ import annotations

import sys
import threading
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


class _DeferredKernel:
    """A ``@triton.jit`` kernel before Triton is imported: launched
    (``kernel[grid](...)``) or asked anything, it imports Triton and acts
    as the ``JITFunction`` it then is."""

    __slots__ = ("fn", "options", "kernel")

    def __init__(self, fn: Any, options: dict[str, Any]) -> None:
        self.fn, self.options = fn, options
        self.kernel: Any = None
        with _lock:
            _deferred.append(self)

    def jitted(self) -> Any:
        if self.kernel is None:
            _load()
        return self.kernel

    def __getitem__(self, grid: Any) -> Any:
        return self.jitted()[grid]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.jitted()(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.jitted(), name)


class _LazyTriton(types.ModuleType):
    """``triton`` until it is imported: ``jit`` defers, anything else imports it."""

    def __init__(self) -> None:
        super().__init__("triton")

    def jit(self, fn: Any = None, **options: Any) -> Any:
        if fn is None:  # @triton.jit(...) with arguments
            return lambda fn: self.jit(fn, **options)
        if _loaded is None:
            # Even when something else imported Triton (torch's compiler
            # does): a JITFunction made and never launched is enough for the
            # leak warnings at exit.
            return _DeferredKernel(fn, options)
        real = _load()
        kernel = real.jit(fn, **options)
        _swap(fn.__globals__)
        return kernel

    def __getattr__(self, name: str) -> Any:
        return getattr(_load(), name)


class _LazyLanguage(types.ModuleType):
    """``triton.language`` until Triton is imported."""

    def __init__(self) -> None:
        super().__init__("triton.language")

    def __getattr__(self, name: str) -> Any:
        _load()
        return getattr(sys.modules["triton.language"], name)


_lock = threading.Lock()
_deferred: list[_DeferredKernel] = []
_loaded: Any = None  # the triton module, once _load has run


def _load() -> Any:
    """Import Triton (once), jit the deferred kernels, and put the real
    kernels, ``triton`` and ``tl`` in place of the stand-ins in every kernel
    module's globals and in this module's: Triton's compiler takes a
    kernel's helpers from its globals, and its interpreter patches the ``tl``
    it finds there."""
    global _loaded, triton, tl
    if _loaded is not None:
        return _loaded
    import triton as real
    import triton.language as real_tl

    with _lock:
        if _loaded is None:
            for deferred in _deferred:
                deferred.kernel = real.jit(deferred.fn, **deferred.options)
            triton, tl = real, real_tl
            _loaded = real
            for deferred in _deferred:
                _swap(deferred.fn.__globals__)
            _deferred.clear()
    return _loaded


def _swap(scope: dict[str, Any]) -> None:
    """In one module's globals, the real things for the stand-ins."""
    for name, value in list(scope.items()):
        if isinstance(value, _DeferredKernel) and value.kernel is not None:
            scope[name] = value.kernel
        elif value is _LAZY_TRITON:
            scope[name] = sys.modules["triton"]
        elif value is _LAZY_LANGUAGE:
            scope[name] = sys.modules["triton.language"]


_LAZY_TRITON = _LazyTriton()
_LAZY_LANGUAGE = _LazyLanguage()

triton: Any
tl: Any
if HAS_TRITON:
    triton, tl = _LAZY_TRITON, _LAZY_LANGUAGE
else:
    triton = _TritonPlaceholder()
    tl = _TritonLanguagePlaceholder()


def interpreter_active() -> bool:
    """True when the kernels will run in Triton's CPU interpreter (imports Triton).

    The switch must have been on when Triton was imported: ``triton.language``'s
    own helpers (``tl.zeros``, ``tl.sum``, ...) are jitted then, for the GPU or
    for the interpreter, once.
    """
    if not HAS_TRITON:
        return False
    _load()
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(sys.modules["triton.language"].zeros, InterpretedFunction)


__all__ = ["HAS_TRITON", "interpreter_active", "tl", "triton"]
