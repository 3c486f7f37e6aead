"""torch.distributed groups and collectives (vLLM's vllm/distributed/).

vLLM's package re-exports its submodules (``from vllm.distributed import
get_tp_group``); here the names resolve on first use, so that importing
``tracevllm.distributed.utils`` from the frontend does not load torch before
the engine process is forked. Code in the package imports from the
submodules directly.
"""

from __future__ import annotations

import importlib
from typing import Any

_SUBMODULES = ("parallel_state", "communication_op", "utils")


def __getattr__(name: str) -> Any:
    for submodule in _SUBMODULES:
        module = importlib.import_module(f"{__name__}.{submodule}")
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
