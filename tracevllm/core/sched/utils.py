"""When a request stops.

Mirrors vllm/v1/core/sched/utils.py (``check_stop``, ``remove_all``). Left
out: pooling requests and repetition detection. Stop *strings* are not checked
here but in the frontend's detokenizer, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from tracevllm.request import Request, RequestStatus

T = TypeVar("T")


def remove_all(lst: list[T], items_to_remove: Iterable[T]) -> list[T]:
    """``lst`` without ``items_to_remove``, as a new list."""
    remove = set(items_to_remove)
    return [item for item in lst if item not in remove] if remove else lst


# --8<-- [start:check_stop]
def check_stop(request: Request, max_model_len: int) -> bool:
    """Check the token just appended; on a stop, set the finished status (and
    ``stop_reason`` for a stop token) and return True."""
    params = request.sampling_params
    if request.num_output_tokens < params.min_tokens:
        return False

    last_token_id = request.output_token_ids[-1]
    # eos_token_id is None under ignore_eos. EOS is not a "stop reason".
    if last_token_id == params.eos_token_id:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if last_token_id in (params.stop_token_ids or ()):
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last_token_id
        return True
    if request.num_tokens >= max_model_len or request.num_output_tokens >= request.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False


# --8<-- [end:check_stop]
