"""What crosses the process boundary between the frontend and EngineCore.

Mirrors vllm/v1/engine/__init__.py. Each message is a msgspec Struct encoded as
a msgpack array (``array_like=True``), so a frame holds values, not field names.
Left out: multimodal features, pooling, LoRA and prompt
embeddings.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping
from typing import Any, NamedTuple

import msgspec

from tracevllm.metrics.stats import PrefillStats, SchedulerStats
from tracevllm.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    """Why a request finished. Sent as an int; ``str()`` gives the OpenAI name.

    STOP: a stop string, stop token or EOS. LENGTH: max_tokens or
    max_model_len. ABORT: aborted by the client. ERROR: an engine error.
    """

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

    def __str__(self) -> str:
        return FINISH_REASON_STRINGS[self.value]


FINISH_REASON_STRINGS = ("stop", "length", "abort", "error")


class EngineCoreRequest(
    msgspec.Struct,
    array_like=True,  # type: ignore[call-arg]
    omit_defaults=True,  # type: ignore[call-arg]
    gc=False,  # type: ignore[call-arg]
):  # type: ignore[call-arg]
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    # W3C trace context ("traceparent") of the frontend span that sent it, so
    # that the engine process's spans join the same trace.
    trace_headers: Mapping[str, str] | None = None
    client_index: int = 0
    # The id the user gave; request_id is made unique from it by
    # InputProcessor.assign_request_id, so that a reused id can never be
    # credited with the tokens of the request that had it before.
    external_req_id: str | None = None
    # The data-parallel request wave the frontend saw when it sent this
    # (DPEngineCoreProc, coordinator.py).
    current_wave: int = 0


class EngineCoreEventType(enum.IntEnum):
    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


class EngineCoreEvent(msgspec.Struct):
    """A timestamped event in the engine core (monotonic clock of that process)."""

    type: EngineCoreEventType
    timestamp: float


class LogprobsLists(NamedTuple):
    """Logprobs of one step's sampled tokens, one row per request.

    vLLM keeps numpy arrays here; plain lists are enough at this size and
    encode without a custom hook.
    """

    # [num_reqs, max_num_logprobs + 1]: the sampled id first, then the top-k ids.
    logprob_token_ids: list[list[int]]
    # [num_reqs, max_num_logprobs + 1]
    logprobs: list[list[float]]
    # [num_reqs]: rank of the sampled token in the vocabulary (1 = most likely).
    sampled_token_ranks: list[int]
    # With drafts, a request has a row per emitted token: request r's rows
    # start at cu_num_generated_tokens[r]. None: one row per request.
    cu_num_generated_tokens: list[int] | None = None

    def slice_request(self, req_idx: int, num_positions: int) -> LogprobsLists:
        """The rows of one request: ``num_positions`` of them, one per emitted token."""
        if self.cu_num_generated_tokens is not None:
            req_idx = self.cu_num_generated_tokens[req_idx]
        end_idx = req_idx + num_positions
        return LogprobsLists(
            self.logprob_token_ids[req_idx:end_idx],
            self.logprobs[req_idx:end_idx],
            self.sampled_token_ranks[req_idx:end_idx],
        )


class EngineCoreOutput(
    msgspec.Struct,
    array_like=True,  # type: ignore[call-arg]
    omit_defaults=True,  # type: ignore[call-arg]
    gc=False,  # type: ignore[call-arg]
):  # type: ignore[call-arg]
    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    events: list[EngineCoreEvent] | None = None
    trace_headers: Mapping[str, str] | None = None
    # Sent with the first output: how much of the prompt was cached.
    prefill_stats: PrefillStats | None = None
    # tracevllm: this step's drafts for the request and how many the target
    # accepted (speculative decoding), for its llm_request span.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # What the KV connector returned when the request finished (vLLM's): a
    # producer's tells a consumer where the prompt's KV is.
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class UtilityResult:
    """Wraps a utility call's return value (vLLM pickles it the same way)."""

    def __init__(self, r: Any = None):
        self.result = r


class UtilityOutput(
    msgspec.Struct,
    array_like=True,  # type: ignore[call-arg]
    gc=False,  # type: ignore[call-arg]
):  # type: ignore[call-arg]
    call_id: int
    failure_message: str | None = None
    # msgpack-able result of the utility method.
    result: Any = None


class EngineCoreOutputs(
    msgspec.Struct,
    array_like=True,  # type: ignore[call-arg]
    omit_defaults=True,  # type: ignore[call-arg]
    gc=False,  # type: ignore[call-arg]
):  # type: ignore[call-arg]
    engine_index: int = 0
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    utility_output: UtilityOutput | None = None
    finished_requests: set[str] | None = None
    # Data parallelism, engine to coordinator: the wave this engine finished,
    # or the wave it asks to start (it got a request of an older one while idle).
    wave_complete: int | None = None
    start_wave: int | None = None

    def __post_init__(self) -> None:
        # The engine core's clock when the outputs were made (as vLLM).
        if not self.timestamp:
            self.timestamp = time.monotonic()


class EngineCoreRequestType(enum.Enum):
    """The first frame of every input message: one byte says what follows."""

    ADD = b"\x00"
    ABORT = b"\x01"
    START_DP_WAVE = b"\x02"
    UTILITY = b"\x03"
    # Sentinel used within the engine core process. vLLM puts it on the input
    # queue when the executor fails; tracevllm puts it there when the frontend
    # process dies (payload None: stop quietly) or an I/O thread fails (payload:
    # its exception, which the busy loop raises). See EngineCoreProc.
    EXECUTOR_FAILED = b"\x04"
