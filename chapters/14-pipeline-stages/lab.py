"""Lab 14: the layers of a pipeline stage. Your version of
``tracevllm.distributed.utils.get_pp_indices``.

Read README.md first. Test it with ``make lab CH=14``; plug it into the
engine with ``TRACEVLLM_LAB=14``: every model the engine builds (every
worker, at any pipeline size) then asks your function which decoder layers
it holds.
"""

from __future__ import annotations

from tracevllm import envs


def get_pp_indices(num_hidden_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """The decoder layers ``[start, end)`` that pipeline stage ``pp_rank`` of
    ``pp_size`` runs, out of ``num_hidden_layers``."""
    partition = envs.TRACEVLLM_PP_LAYER_PARTITION  # "8,8,8,6", or None when unset
    # TODO 1: with a partition string, each stage's layer count is its
    #         comma-separated int. Refuse, with a ValueError:
    #         - a string that is not ints: "Invalid partition string: <string>";
    #         - a count of stages other than pp_size:
    #           "len(partitions)=<n> does not match pp_size=<pp_size>.";
    #         - counts that do not add up to num_hidden_layers:
    #           "sum(partitions)=<s> does not match num_hidden_layers=<n>."
    # TODO 2: without one, every stage gets num_hidden_layers // pp_size
    #         layers, and the remainder goes one layer each to the stages just
    #         before the last: the second-to-last first, then the one before it.
    # TODO 3: stage pp_rank starts after the layers of the stages before it.
    del partition
    raise NotImplementedError("Lab 14: get_pp_indices (see chapters/14-pipeline-stages)")
