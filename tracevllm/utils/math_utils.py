"""Integer arithmetic the scheduler, KV manager and input processor share.

Mirrors vllm/utils/math_utils.py (``cdiv``). A helper used on both sides of
the process boundary lives here, so the frontend never imports the core for it.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division: blocks needed for ``a`` tokens at ``b`` per block."""
    return -(-a // b)
