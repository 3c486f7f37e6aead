"""The engine core's view of one request.

Mirrors vllm/v1/request.py (``Request``, ``RequestStatus``). Left out:
multimodal, pooling, LoRA, streaming input.
Block hashes for prefix caching are computed here, as in vLLM: the hasher is
called whenever tokens are appended, and hashes every newly full block.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from tracevllm.engine import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreRequest,
    FinishReason,
)
from tracevllm.metrics.stats import PrefillStats
from tracevllm.sampling_params import SamplingParams
from tracevllm.structured_output.request import StructuredOutputRequest

if TYPE_CHECKING:
    from tracevllm.core.kv_cache_utils import BlockHash


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        trace_headers: Mapping[str, str] | None = None,
        block_hasher: Callable[[Request], list[BlockHash]] | None = None,
        client_index: int = 0,
    ) -> None:
        self.request_id = request_id
        self.client_index = client_index
        self.priority = priority
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.trace_headers = trace_headers

        self.status = RequestStatus.WAITING
        # Its grammar compiles first (StructuredOutputManager.grammar_init);
        # until then the scheduler passes it over.
        self.structured_output_request = StructuredOutputRequest.from_sampling_params(
            sampling_params
        )
        if self.structured_output_request is not None:
            self.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
        # A KV connector's parameters (vLLM's: from extra_args["kv_transfer_params"]).
        self.kv_transfer_params: dict[str, Any] | None = None
        if sampling_params.extra_args is not None:
            self.kv_transfer_params = sampling_params.extra_args.get("kv_transfer_params")
        self.events: list[EngineCoreEvent] = []
        self.stop_reason: int | str | None = None

        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(prompt_token_ids)
        # Draft tokens proposed for the next step (speculative decoding): not
        # outputs until the target model accepts them.
        self.spec_token_ids: list[int] = []
        # Tokens whose KV is in the cache (or scheduled to be this step).
        self.num_computed_tokens = 0
        # This step's chunk stops short of its known tokens: its sample is
        # thrown away, so it gets no grammar bitmask row.
        self.is_prefill_chunk = False
        # Async scheduling: tokens sampled in steps still in flight, counted
        # as computed but not yet known (AsyncScheduler).
        self.num_output_placeholders = 0
        # In-flight outputs to drop when they arrive (after reset_prefix_cache
        # preempted the request mid-step).
        self.async_tokens_to_discard = 0
        # Filled when first scheduled (prefix-cache hits), sent with the first output.
        self.prefill_stats: PrefillStats | None = PrefillStats()
        self.num_preemptions = 0
        # tracevllm's own: it gave back the blocks of a finished asynchronous
        # load (Scheduler._free_loaded_waiting_request), so its next admission
        # continues the first one, whose prefill stats and connector lookup
        # were recorded already.
        self.gave_back_loaded_blocks = False

        assert sampling_params.max_tokens is not None, "InputProcessor sets max_tokens"
        self.max_tokens = sampling_params.max_tokens

        self.block_hashes: list[BlockHash] = []
        self._block_hasher = block_hasher
        self.update_block_hashes()

    @classmethod
    def from_engine_core_request(
        cls,
        request: EngineCoreRequest,
        block_hasher: Callable[[Request], list[BlockHash]] | None,
    ) -> Request:
        return cls(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            arrival_time=request.arrival_time,
            priority=request.priority,
            trace_headers=request.trace_headers,
            block_hasher=block_hasher,
            client_index=request.client_index,
        )

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self._output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)
        self.update_block_hashes()

    def update_block_hashes(self) -> None:
        """Hash any block that became full (vLLM: ``Request.update_block_hashes``)."""
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self._all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def use_structured_output(self) -> bool:
        return self.structured_output_request is not None

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        return RequestStatus.get_finished_reason(self.status)

    def record_event(self, event_type: EngineCoreEventType, timestamp: float | None = None) -> None:
        self.events.append(
            EngineCoreEvent(type=event_type, timestamp=timestamp or time.monotonic())
        )

    def take_events(self) -> list[EngineCoreEvent] | None:
        if not self.events:
            return None
        events, self.events = self.events, []
        return events

    def take_prefill_stats(self) -> PrefillStats | None:
        prefill_stats, self.prefill_stats = self.prefill_stats, None
        return prefill_stats

    def __lt__(self, other: Request) -> bool:
        """Order for the priority queue: (priority, arrival_time, request_id)."""
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority,
            other.arrival_time,
            other.request_id,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )


class RequestStatus(enum.IntEnum):
    """Status of a request. Everything after PREEMPTED is finished."""

    WAITING = enum.auto()
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = enum.auto()
    # A KV connector is loading its prompt's KV asynchronously.
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()

    def __str__(self) -> str:
        return self.name

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> FinishReason | None:
        return _FINISHED_REASON_MAP.get(status)


# An ignored request is one whose prompt can never fit: "length", as OpenAI's API.
_FINISHED_REASON_MAP = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}
