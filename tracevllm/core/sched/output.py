"""What the scheduler hands the model runner each step.

Mirrors vllm/v1/core/sched/output.py (``NewRequestData``,
``CachedRequestData``, ``SchedulerOutput``). The first time a request is
scheduled the runner gets everything about it (``NewRequestData``); after
that only what changed (``CachedRequestData``), because the runner keeps its
own persistent copy of each request (``InputBatch``). ``GrammarOutput`` is
the structured requests' token bitmask, made after the schedule
(``Scheduler.get_grammar_bitmask``). Left out: multimodal, LoRA and pooling
fields, and ``num_invalid_spec_tokens`` (async scheduling).
Block ids are a tuple with one list per KV cache group; tracevllm has one group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from tracevllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from tracevllm.request import Request
    from tracevllm.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int

    @classmethod
    def from_request(cls, request: Request, block_ids: tuple[list[int], ...]) -> NewRequestData:
        return cls(
            req_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            block_ids=block_ids,
            num_computed_tokens=request.num_computed_tokens,
        )


@dataclass(slots=True)
class CachedRequestData:
    """Requests the runner has seen before, as parallel lists."""

    req_ids: list[str] = field(default_factory=list)
    # Requests that were preempted and are scheduled again: the runner must
    # replace (not extend) their block ids.
    resumed_req_ids: set[str] = field(default_factory=set)
    # Only used by pipeline parallelism in vLLM; kept for shape.
    new_token_ids: list[list[int]] = field(default_factory=list)
    # All token ids of requests not scheduled last step (vLLM: for KV
    # connectors and async scheduling; the synchronous runner has its own copy).
    all_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Blocks appended this step (None: none).
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    num_output_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @classmethod
    def make_empty(cls) -> CachedRequestData:
        return cls()


@dataclass(slots=True)
class SchedulerOutput:
    # Requests scheduled for the first time (or again after preemption).
    scheduled_new_reqs: list[NewRequestData]
    # Requests the runner already holds.
    scheduled_cached_reqs: CachedRequestData
    # req_id -> tokens to compute this step.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # req_id -> the draft tokens to verify this step (speculative decoding);
    # a request with no drafts this step is not in it.
    scheduled_spec_decode_tokens: dict[str, list[int]]
    # Leading blocks shared by every running request (cascade attention hint).
    num_common_prefix_blocks: list[int]
    # Requests that finished since the last step: the runner drops them.
    finished_req_ids: set[str]
    # Requests preempted this step.
    preempted_req_ids: set[str] | None = None
    # Some scheduled request samples under a grammar this step (a prefill
    # chunk that stops short does not): get_grammar_bitmask has work to do.
    has_structured_output_requests: bool = False
    # Async scheduling: a structured request's last token is still in flight,
    # so its bitmask (and the step's sampling) waits for that step's output.
    pending_structured_output_tokens: bool = False
    # What the KV connector's workers load and save this step (its
    # build_connector_meta); None without a connector.
    kv_connector_metadata: KVConnectorMetadata | None = None
    # tracevllm: the step number, for spans and views.
    step_id: int = 0

    @classmethod
    def make_empty(cls) -> SchedulerOutput:
        return cls(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=CachedRequestData.make_empty(),
            num_scheduled_tokens={},
            total_num_scheduled_tokens=0,
            scheduled_spec_decode_tokens={},
            num_common_prefix_blocks=[],
            finished_req_ids=set(),
        )


@dataclass(slots=True)
class GrammarOutput:
    # The structured requests scheduled this step (not mid-prefill), in the
    # bitmask's row order.
    structured_output_request_ids: list[str]
    # [len(structured_output_request_ids), ceil(vocab_size / 32)], int32:
    # bit t of a row set iff token t is allowed next.
    grammar_bitmask: npt.NDArray[np.int32]
