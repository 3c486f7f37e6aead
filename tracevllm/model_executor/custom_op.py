"""A layer with a kernel of its own beside its plain-PyTorch path.

Mirrors vllm/model_executor/custom_op.py (``CustomOp``): a layer writes
``forward_native`` (PyTorch ops: the reference, and what Inductor fuses when
the model is compiled) and may write ``forward_cpu`` (vLLM's C++ CPU
kernels); ``forward`` runs the one ``dispatch_forward`` picked when the layer
was built. Whether a layer's own kernel is on follows vLLM's
``compilation_config.custom_ops``: "all" (the default when nothing is
compiled) or "none" (the default when Inductor compiles), then "+name" or
"-name" for one op, by the name the class was registered under
(``@CustomOp.register("rms_norm")``). ``--compilation-config
'{"custom_ops": ["none"]}'`` runs every layer's ``forward_native``.

tracevllm's kernels are float32 and CPU only, so a ``forward_cpu`` first
asks ``cpu_kernel_fits`` and takes ``forward_native`` for any other input
(another dtype, a layout the kernel does not take). Left out: the other
platforms' ``forward_*`` (CUDA runs ``forward_native``), out-of-tree
overrides, and compiling ``forward_native`` on its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from tracevllm.config import get_current_vllm_config

op_registry: dict[str, type[CustomOp]] = {}


class CustomOp(nn.Module):
    name: ClassVar[str]

    def __init__(self) -> None:
        super().__init__()
        self._forward_method: Callable[..., Any] = self.dispatch_forward()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward_method(*args, **kwargs)

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def forward_cpu(self, *args: Any, **kwargs: Any) -> Any:
        # A layer without a CPU kernel runs its PyTorch ops (vLLM's default).
        return self.forward_native(*args, **kwargs)

    # --8<-- [start:dispatch_forward]
    def dispatch_forward(self) -> Callable[..., Any]:
        """``forward_cpu`` where ``uses_own_kernel``, else ``forward_native``.
        The tensors are not known yet (a model is built on the meta device,
        then moved), so ``forward_cpu`` checks each input: see
        ``cpu_kernel_fits``."""
        return self.forward_cpu if self.uses_own_kernel() else self.forward_native

    @classmethod
    def uses_own_kernel(cls) -> bool:
        """Whether a layer of this class built now takes its kernel: the op is
        enabled, the engine runs on the CPU (vLLM picks by platform the same
        way), and the C++ kernels were built on this machine."""
        config = get_current_vllm_config()
        device = config.device_config.device if config is not None else "cpu"
        if not cls.enabled() or device != "cpu":
            return False
        from kernels.cpu_attn import cpu_kernels_available

        return cpu_kernels_available()

    # --8<-- [end:dispatch_forward]

    @classmethod
    def enabled(cls) -> bool:
        """vLLM's rule: on if "all" (or "+name"), off if "none" (or "-name")."""
        config = get_current_vllm_config()
        custom_ops = config.compilation_config.custom_ops if config is not None else []
        if f"-{cls.name}" in custom_ops:
            return False
        return f"+{cls.name}" in custom_ops or "none" not in custom_ops

    @classmethod
    def register(cls, name: str) -> Callable[[type[CustomOp]], type[CustomOp]]:
        """Name a layer class, as ``custom_ops`` spells it (vLLM's decorator)."""

        def decorator(op_cls: type[CustomOp]) -> type[CustomOp]:
            assert name not in op_registry, f"Duplicate op name: {name}"
            op_cls.name = name
            op_registry[name] = op_cls
            return op_cls

        return decorator


def cpu_kernel_fits(*tensors: torch.Tensor | None) -> bool:
    """True where the C++ kernels take these tensors: float32 on the CPU,
    2-D with each row contiguous, and not inside a Dynamo trace (a compiled
    model that asked for the kernels with "+name" gets the native ops, which
    Inductor can fuse, rather than an op it cannot trace)."""
    if torch.compiler.is_compiling():
        return False
    return all(t is None or _rows_fit(t) for t in tensors)


def _rows_fit(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.dim() == 2 and t.stride(1) == 1
