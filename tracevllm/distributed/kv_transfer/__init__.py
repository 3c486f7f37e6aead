"""KV cache transfer between engines: the connector and its process-wide handle.

Mirrors vllm/distributed/kv_transfer/__init__.py: ``get_kv_transfer_group``,
``has_kv_transfer_group``, ``ensure_kv_transfer_initialized`` and
``ensure_kv_transfer_shutdown`` (kv_transfer_state.py). The names resolve on
first use, so that the frontend importing ``KVTransferConfig`` does not load
torch before the engine process is forked.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "get_kv_transfer_group": "kv_transfer_state",
    "has_kv_transfer_group": "kv_transfer_state",
    "is_v1_kv_transfer_group": "kv_transfer_state",
    "ensure_kv_transfer_initialized": "kv_transfer_state",
    "ensure_kv_transfer_shutdown": "kv_transfer_state",
    "KVTransferConfig": "kv_transfer_config",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
