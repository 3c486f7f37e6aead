"""Small helpers for splitting a model across ranks.

Mirrors vllm/distributed/utils.py (``ensure_divisibility``, ``divide``,
``split_tensor_along_last_dim``, ``get_pp_indices``); the addresses ranks
meet at are in tracevllm/utils/network_utils.py, as vLLM's.
``temporary_file_init_method`` is tracevllm's own: the rendezvous a world of
one process can use (see its docstring). Left out: the stateless process
groups (vLLM's DP coordination outside torch.distributed) and the
node-topology helpers.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from tracevllm import envs
from tracevllm.labs import lab_hook

if TYPE_CHECKING:
    import torch


def ensure_divisibility(numerator: int, denominator: int) -> None:
    """``numerator`` must split evenly into ``denominator`` parts."""
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")


def divide(numerator: int, denominator: int) -> int:
    """``numerator // denominator``, refusing a remainder."""
    ensure_divisibility(numerator, denominator)
    return numerator // denominator


def split_tensor_along_last_dim(
    tensor: torch.Tensor, num_partitions: int, contiguous_split_chunks: bool = False
) -> Sequence[torch.Tensor]:
    """``num_partitions`` equal views of ``tensor`` along its last dimension."""
    last_dim_size = divide(tensor.shape[-1], num_partitions)
    chunks = tensor.split(last_dim_size, dim=-1)
    if contiguous_split_chunks:
        return tuple(chunk.contiguous() for chunk in chunks)
    return chunks


# --8<-- [start:get_pp_indices]
@lab_hook("get_pp_indices")  # lab 14: chapters/14-pipeline-stages
def get_pp_indices(num_hidden_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """The decoder layers ``[start, end)`` that pipeline stage ``pp_rank`` runs.

    Layers are shared out evenly; a remainder goes one layer each to the
    stages just before the last (the last stage also holds the final norm
    and the LM head, the first the embedding), as vLLM does. E.g. 30 layers
    over 4 stages: [7, 8, 8, 7]. ``TRACEVLLM_PP_LAYER_PARTITION="8,8,8,6"``
    sets the split by hand.
    """
    partition = envs.TRACEVLLM_PP_LAYER_PARTITION
    if partition is not None:
        try:
            partitions = [int(layers) for layers in partition.split(",")]
        except ValueError as err:
            raise ValueError(f"Invalid partition string: {partition}") from err
        if len(partitions) != pp_size:
            raise ValueError(f"len(partitions)={len(partitions)} does not match pp_size={pp_size}.")
        if sum(partitions) != num_hidden_layers:
            raise ValueError(
                f"sum(partitions)={sum(partitions)} does not match "
                f"num_hidden_layers={num_hidden_layers}."
            )
    else:
        partitions = [num_hidden_layers // pp_size] * pp_size
        remaining = num_hidden_layers % pp_size
        for i in range(2, remaining + 2):
            partitions[-i] += 1
    start_layer = sum(partitions[:pp_rank])
    return start_layer, start_layer + partitions[pp_rank]


# --8<-- [end:get_pp_indices]


@contextlib.contextmanager
def temporary_file_init_method() -> Iterator[str]:
    """A ``file://`` rendezvous in a private temporary directory, removed on exit.

    For a world of one process (``UniProcExecutor``). vLLM gives it a
    ``tcp://`` address, whose key-value store then listens on every network
    interface for as long as the process lives; a file store needs no port.
    Every group is made inside the ``with`` block (``initialize_model_parallel``),
    after which nothing reads the store, so the directory can go at once.
    """
    tmp = tempfile.mkdtemp(prefix="tracevllm-dist-")
    try:
        yield f"file://{tmp}/store"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
