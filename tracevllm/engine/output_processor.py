"""Turn the engine core's token ids into ``RequestOutput``s, in the frontend.

Mirrors vllm/v1/engine/output_processor.py (``RequestState``,
``OutputProcessor.process_outputs``, ``OutputProcessorOutput``). Per output:
timestamps, incremental detokenization, stop strings (which finish the request
here and ask the core to abort it), logprobs, and a ``RequestOutput`` when the
output kind asks for one. Left out: the asyncio output queues, pooling,
LoRA stats and the Prometheus iteration stats.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.trace import Span

from tracevllm import tracing
from tracevllm.engine import (
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
)
from tracevllm.engine.detokenizer import IncrementalDetokenizer
from tracevllm.engine.logprobs import LogprobsProcessor
from tracevllm.engine.parallel_sampling import ParentRequest
from tracevllm.metrics.stats import RequestStateStats
from tracevllm.outputs import CompletionOutput, RequestOutput
from tracevllm.sampling_params import RequestOutputKind
from tracevllm.tracing.attributes import SpanAttributes


class RequestState:
    """Everything the frontend tracks about one (child) request."""

    def __init__(
        self,
        tokenizer: Any,
        request: EngineCoreRequest,
        prompt: str | None,
        parent_req: ParentRequest | None,
        request_index: int,
        span: Span | None = None,
    ) -> None:
        self.request_id = request.request_id
        self.parent_req = parent_req
        self.request_index = request_index
        self.prompt = prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.output_kind = request.sampling_params.output_kind
        self.detokenizer = IncrementalDetokenizer(tokenizer, request)
        self.logprobs_processor = LogprobsProcessor(tokenizer, request)
        self.stats = RequestStateStats(arrival_time=request.arrival_time)
        self.num_cached_tokens = 0
        self.trace_headers = request.trace_headers
        # Filled when the request finishes, for the llm_request span.
        self.finish_reason: FinishReason | None = None
        self.sampling_params = request.sampling_params
        # The request's llm_request span (tracing on), and when tokens arrived.
        self.span = span
        self.token_times: list[float] = []

    def make_request_output(
        self,
        new_token_ids: list[int],
        finish_reason: FinishReason | None,
        stop_reason: int | str | None,
    ) -> RequestOutput | None:
        """The ``RequestOutput`` for this step, or None when none is due.

        ``new_token_ids`` are the tokens that arrived in this step's output:
        a DELTA output carries only those.
        """
        finished = finish_reason is not None
        if self.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        completion = self._new_completion_output(new_token_ids, finish_reason, stop_reason)
        request_id = self.request_id
        outputs = [completion]
        if self.parent_req is not None:
            # A child's output goes out under the parent's id (FINAL_ONLY: all
            # n at once, when the last child finishes).
            outputs, finished = self.parent_req.get_outputs(self.request_id, completion)
            if not outputs:
                return None
            request_id = self.parent_req.request_id
        return RequestOutput(
            request_id=request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=self.num_cached_tokens,
            metrics=self.stats,
        )

    def _new_completion_output(
        self,
        new_token_ids: list[int],
        finish_reason: FinishReason | None,
        stop_reason: int | str | None,
    ) -> CompletionOutput:
        finished = finish_reason is not None
        delta = self.output_kind == RequestOutputKind.DELTA
        text = self.detokenizer.get_next_output_text(finished, delta)
        token_ids = self.detokenizer.token_ids
        logprobs = self.logprobs_processor.logprobs
        if delta:
            # The detokenizer appended exactly these ids, so its tail is them.
            num_new = len(new_token_ids)
            token_ids = token_ids[-num_new:] if num_new else []
            if logprobs is not None:
                logprobs = logprobs[-num_new:] if num_new else []
        return CompletionOutput(
            index=self.request_index,
            text=text,
            token_ids=list(token_ids),
            cumulative_logprob=self.logprobs_processor.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=str(finish_reason) if finished else None,
            stop_reason=stop_reason if finished else None,
        )

    def completion_summary(self) -> CompletionOutput:
        """The whole completion so far, whatever the output kind: for the ``llm_request`` span."""
        return CompletionOutput(
            index=self.request_index,
            text=self.detokenizer.output_text,
            token_ids=list(self.detokenizer.token_ids),
            cumulative_logprob=self.logprobs_processor.cumulative_logprob,
            logprobs=None,
            finish_reason=str(self.finish_reason) if self.finish_reason else None,
        )


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput]
    # Requests the frontend finished (stop strings): the core must abort them.
    reqs_to_abort: list[str]
    # Requests that finished this step, with their state (for llm_request spans).
    finished_states: list[RequestState] = field(default_factory=list)


class OutputProcessor:
    """Process EngineCoreOutputs into RequestOutputs."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def has_unfinished_requests(self) -> bool:
        return len(self.request_states) > 0

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        parent_req: ParentRequest | None = None,
        request_index: int = 0,
        span: Span | None = None,
    ) -> None:
        if request.request_id in self.request_states:
            raise ValueError(f"Request id {request.request_id} already running.")
        self.request_states[request.request_id] = RequestState(
            self.tokenizer, request, prompt, parent_req, request_index, span
        )
        if parent_req is not None:
            self.parent_requests[parent_req.request_id] = parent_req

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget these requests (parent ids expand to their children).

        Returns the child ids the engine core must abort."""
        to_abort: list[str] = []
        for request_id in request_ids:
            parent = self.parent_requests.pop(request_id, None)
            children = list(parent.child_requests) if parent else [request_id]
            for child_id in children:
                state = self.request_states.pop(child_id, None)
                if state is not None:
                    to_abort.append(child_id)
                    if state.span is not None and state.span.is_recording():
                        state.finish_reason = FinishReason.ABORT
                        self.do_tracing(state, [])
        return to_abort

    # --8<-- [start:process_outputs]
    @tracing.instrument("OutputProcessor.process_outputs")
    def process_outputs(
        self, engine_core_outputs: list[EngineCoreOutput], engine_core_timestamp: float = 0.0
    ) -> OutputProcessorOutput:
        """One pass over the step's outputs: detokenize, stop, make outputs.

        Unlike vLLM, which loops once here for a whole batch of AsyncLLM
        streams, the sync path returns outputs straight to LLMEngine.step.
        """
        request_outputs: list[RequestOutput] = []
        reqs_to_abort: list[str] = []
        finished_states: list[RequestState] = []
        now = time.time()
        for output in engine_core_outputs:
            req_state = self.request_states.get(output.request_id)
            if req_state is None:
                # Aborted in the frontend while the core was still running it.
                continue
            self._update_stats(req_state, output, now)
            new_token_ids = output.new_token_ids
            finish_reason = output.finish_reason
            stop_reason = output.stop_reason
            req_state.num_cached_tokens = output.num_cached_tokens

            # Detokenize, then check stop strings.
            stop_string = req_state.detokenizer.update(
                new_token_ids, finish_reason == FinishReason.STOP
            )
            if stop_string is not None:
                finish_reason = FinishReason.STOP
                stop_reason = stop_string
            req_state.logprobs_processor.update_from_output(output.new_logprobs)

            request_output = req_state.make_request_output(
                new_token_ids, finish_reason, stop_reason
            )
            if request_output is not None:
                request_outputs.append(request_output)
            if finish_reason is not None:
                req_state.finish_reason = finish_reason
                if req_state.span is not None:
                    self._trace_finished(req_state)
                self.request_states.pop(output.request_id)
                if req_state.parent_req is not None and not req_state.parent_req.child_requests:
                    self.parent_requests.pop(req_state.parent_req.request_id, None)
                finished_states.append(req_state)
                if not output.finished:
                    # Finished here (a stop string): the core is still running it.
                    reqs_to_abort.append(output.request_id)
        span = tracing.current_span()
        if span.is_recording():
            span.set_attribute(
                SpanAttributes.REQUEST_IDS, [o.request_id for o in engine_core_outputs]
            )
            span.set_attribute(
                "tracevllm.new_token_ids", [len(o.new_token_ids) for o in engine_core_outputs]
            )
            span.set_attribute("tracevllm.finished", [s.request_id for s in finished_states])
        return OutputProcessorOutput(request_outputs, reqs_to_abort, finished_states)

    # --8<-- [end:process_outputs]

    # --8<-- [start:do_tracing]
    def _trace_finished(self, req_state: RequestState) -> None:
        """End the request's span once it is done: for n > 1, once all n children are.

        The children share the parent's span; the whole completions are
        summed up, not the last (DELTA: partial) outputs.
        """
        summary = req_state.completion_summary()
        parent = req_state.parent_req
        if parent is None:
            self.do_tracing(req_state, [summary])
            return
        parent.finished_completions.append(summary)
        if not parent.child_requests:
            completions = sorted(parent.finished_completions, key=lambda c: c.index)
            self.do_tracing(req_state, completions)

    def do_tracing(self, req_state: RequestState, completions: list[CompletionOutput]) -> None:
        """End the request's ``llm_request`` span with vLLM's GenAI attributes.

        Core timestamps (queued, scheduled) are the core's monotonic clock;
        only their differences are used. Frontend times are wall clock.
        """
        span = req_state.span
        if span is None or not span.is_recording():
            return
        stats, params = req_state.stats, req_state.sampling_params
        now = time.time()
        output_tokens = sum(len(c.token_ids) for c in completions)
        times = req_state.token_times
        attrs: dict[str, Any] = {
            SpanAttributes.GEN_AI_REQUEST_ID: req_state.parent_req.request_id
            if req_state.parent_req
            else req_state.request_id,
            SpanAttributes.GEN_AI_REQUEST_MAX_TOKENS: params.max_tokens or 0,
            SpanAttributes.GEN_AI_REQUEST_TEMPERATURE: params.temperature,
            SpanAttributes.GEN_AI_REQUEST_TOP_P: params.top_p,
            SpanAttributes.GEN_AI_REQUEST_TOP_K: params.top_k,
            SpanAttributes.GEN_AI_REQUEST_N: req_state.parent_req.n if req_state.parent_req else 1,
            SpanAttributes.GEN_AI_USAGE_PROMPT_TOKENS: len(req_state.prompt_token_ids),
            SpanAttributes.GEN_AI_USAGE_INPUT_TOKENS: len(req_state.prompt_token_ids),
            SpanAttributes.GEN_AI_USAGE_COMPLETION_TOKENS: output_tokens,
            SpanAttributes.GEN_AI_USAGE_OUTPUT_TOKENS: output_tokens,
            SpanAttributes.GEN_AI_RESPONSE_FINISH_REASONS: [
                c.finish_reason or "abort" for c in completions
            ]
            or [str(req_state.finish_reason)],
            SpanAttributes.GEN_AI_LATENCY_E2E: now - stats.arrival_time,
            "tracevllm.num_cached_tokens": req_state.num_cached_tokens,
            "tracevllm.completion.text": "\n---\n".join(c.text for c in completions),
            "tracevllm.latency.inter_token_ms": [(b - a) * 1e3 for a, b in zip(times, times[1:])],
        }
        if params.seed is not None:
            attrs[SpanAttributes.GEN_AI_REQUEST_SEED] = params.seed
        if stats.scheduled_ts and stats.queued_ts:
            attrs[SpanAttributes.GEN_AI_LATENCY_TIME_IN_QUEUE] = (
                stats.scheduled_ts - stats.queued_ts
            )
        if stats.first_token_ts:
            attrs[SpanAttributes.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] = stats.first_token_latency
            attrs[SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE] = (
                stats.last_token_ts - stats.first_token_ts
            )
        span.set_attributes(attrs)
        span.end()

    # --8<-- [end:do_tracing]

    @staticmethod
    def _update_stats(req_state: RequestState, output: EngineCoreOutput, now: float) -> None:
        stats = req_state.stats
        for event in output.events or []:
            # Core events carry the core's monotonic clock: use their differences.
            if event.type == EngineCoreEventType.QUEUED:
                stats.queued_ts = event.timestamp
            elif event.type == EngineCoreEventType.SCHEDULED and not stats.scheduled_ts:
                stats.scheduled_ts = event.timestamp
        if output.new_token_ids:
            if req_state.span is not None:
                req_state.token_times.append(now)
            if not stats.first_token_ts:
                stats.first_token_ts = now
                stats.first_token_latency = now - stats.arrival_time
            stats.last_token_ts = now
            stats.num_generation_tokens += len(output.new_token_ids)
