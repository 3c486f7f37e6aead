"""Ray helpers for the ``"ray"`` executor backend.

Mirrors vllm/v1/executor/ray_utils.py. So far only the availability checks
(``ray_is_available``, ``assert_ray_available``): Ray is an optional extra,
imported only when asked for.
"""

from __future__ import annotations

import importlib.util


def ray_is_available() -> bool:
    """Whether Ray can be imported (without importing it)."""
    return importlib.util.find_spec("ray") is not None


def assert_ray_available() -> None:
    """vLLM's error when the ``"ray"`` backend is asked for without Ray."""
    if not ray_is_available():
        raise ValueError(
            "Failed to import Ray: No module named 'ray'. "
            "Please install Ray with `pip install ray` (tracevllm: `pip install -e .[ray]`)."
        )
