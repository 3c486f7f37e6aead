"""Collectives over the tensor-parallel group, the ones the layers call.

Mirrors vllm/distributed/communication_op.py. Each is one line: the layer
code says *what* crosses ranks, ``GroupCoordinator`` says *how* (and, at
trace detail "full", records each as a span). Left out:
``tensor_model_parallel_reduce_scatter`` (sequence parallelism).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed

from tracevllm.distributed.parallel_state import get_tp_group


def tensor_model_parallel_all_reduce(input_: torch.Tensor) -> torch.Tensor:
    """Sum over the TP ranks (RowParallelLinear, VocabParallelEmbedding)."""
    return get_tp_group().all_reduce(input_)


def tensor_model_parallel_all_gather(input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate the TP ranks' pieces along ``dim`` (the LM head's logits)."""
    return get_tp_group().all_gather(input_, dim)


def tensor_model_parallel_gather(
    input_: torch.Tensor, dst: int = 0, dim: int = -1
) -> torch.Tensor | None:
    """Like all-gather, but only TP rank ``dst`` gets the result."""
    return get_tp_group().gather(input_, dst, dim)


def broadcast_tensor_dict(
    tensor_dict: dict[Any, torch.Tensor | Any] | None = None, src: int = 0
) -> dict[Any, torch.Tensor | Any] | None:
    """TP rank ``src``'s dict of tensors and values to every TP rank."""
    if not torch.distributed.is_initialized():
        return tensor_dict
    return get_tp_group().broadcast_tensor_dict(tensor_dict, src)
