"""Attributes a weight carries for its loader.

Mirrors vllm/model_executor/utils.py (``set_weight_attrs``): a parameter
says how it is sharded (``output_dim``, ``input_dim``) and which function
copies this rank's part of a checkpoint tensor into it (``weight_loader``).
"""

from __future__ import annotations

from typing import Any

import torch


def set_weight_attrs(weight: torch.Tensor, weight_attrs: dict[str, Any] | None) -> None:
    """Set each attribute on ``weight``, refusing to overwrite one."""
    if weight_attrs is None:
        return
    for key, value in weight_attrs.items():
        assert not hasattr(weight, key), f"Overwriting existing tensor attribute: {key}"
        setattr(weight, key, value)
