"""Turn the engine core's token ids into ``RequestOutput``s, in the frontend.

Mirrors vllm/v1/engine/output_processor.py (``RequestState``,
``OutputProcessor.process_outputs``, ``OutputProcessorOutput``). Per output:
stats, incremental detokenization, stop strings (which finish the request
here and ask the core to abort it), logprobs, and a ``RequestOutput`` when
the output kind asks for one. Requests are keyed by their internal id; the
user's id (``external_req_id``) is what outputs carry and what
``abort_requests`` may be given. For ``AsyncLLM``, each request's outputs go
to its ``RequestOutputCollector`` instead of being returned. Left out: pooling,
LoRA stats, streaming input, ``stream_interval``. The ``llm_request`` span is started when the
request arrives (tracing/request_span.py), not made here when it finishes.
Departure: tokens that a step brought after a stop string (speculative
decoding) are dropped, with their logprobs and from the counts (vLLM keeps
them in ``token_ids``; see detokenizer.py).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tracevllm import tracing
from tracevllm.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
from tracevllm.engine.detokenizer import IncrementalDetokenizer
from tracevllm.engine.logprobs import LogprobsProcessor
from tracevllm.engine.parallel_sampling import ParentRequest
from tracevllm.metrics.stats import IterationStats, RequestStateStats
from tracevllm.outputs import CompletionOutput, RequestOutput
from tracevllm.sampling_params import RequestOutputKind
from tracevllm.tracing import records
from tracevllm.tracing.request_span import find_request_span


# --8<-- [start:request_output_collector]
class RequestOutputCollector:
    """One request's outputs, handed from the output handler to its generate().

    AsyncLLM's output-handler task puts; the request's ``generate()`` gets.
    There is one slot, not a queue: if the producer gets ahead, DELTA
    outputs are merged and the other kinds replaced, so a slow reader
    catches up in one read instead of falling ever further behind.
    """

    def __init__(self, output_kind: RequestOutputKind, request_id: str) -> None:
        self.aggregate = output_kind == RequestOutputKind.DELTA
        self.request_id = request_id
        self.output: RequestOutput | Exception | None = None
        self.ready = asyncio.Event()

    def put(self, output: RequestOutput | Exception) -> None:
        """Non-blocking put (the output handler must never wait on a reader)."""
        if self.output is None or isinstance(output, Exception):
            self.output = output
            self.ready.set()
        elif isinstance(self.output, RequestOutput):
            self.output.add(output, aggregate=self.aggregate)

    async def get(self) -> RequestOutput:
        """Wait for the next output (an exception put here is raised)."""
        while (output := self.output) is None:
            await self.ready.wait()
        self.output = None
        self.ready.clear()
        if isinstance(output, Exception):
            raise output
        return output

    def get_nowait(self) -> RequestOutput | None:
        output = self.output
        if output is not None:
            self.output = None
            self.ready.clear()
        if isinstance(output, Exception):
            raise output
        return output


# --8<-- [end:request_output_collector]


class RequestState:
    """Everything the frontend tracks about one (child) request."""

    def __init__(
        self,
        tokenizer: Any,
        request: EngineCoreRequest,
        prompt: str | None,
        parent_req: ParentRequest | None,
        request_index: int,
        queue: RequestOutputCollector | None = None,
    ) -> None:
        assert request.external_req_id is not None
        self.request_id = request.request_id
        self.external_req_id = request.external_req_id
        self.parent_req = parent_req
        self.request_index = request_index
        self.prompt = prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.sampling_params = request.sampling_params
        self.output_kind = request.sampling_params.output_kind
        self.max_tokens_param = request.sampling_params.max_tokens
        self.detokenizer = IncrementalDetokenizer(tokenizer, request)
        self.logprobs_processor = LogprobsProcessor(tokenizer, request)
        self.is_prefilling = True
        self.num_cached_tokens = 0
        self.stats = RequestStateStats(arrival_time=request.arrival_time)
        # AsyncLLM: the per-request collector generate() reads from.
        self.queue = queue
        # The request's llm_request span, when tracing (shared by n children):
        # the one its trace headers name.
        self.span = find_request_span(request.trace_headers)

    def make_request_output(
        self,
        new_token_ids: list[int],
        finish_reason: FinishReason | None,
        stop_reason: int | str | None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> RequestOutput | None:
        """The ``RequestOutput`` for this step, or None when none is due.

        ``new_token_ids`` are the tokens that arrived in this step's output:
        a DELTA output carries only those.
        """
        finished = finish_reason is not None
        if self.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        completion = self._new_completion_output(new_token_ids, finish_reason, stop_reason)
        external_req_id = self.external_req_id
        outputs = [completion]
        if self.parent_req is not None:
            # A child's output goes out under the parent's id (FINAL_ONLY: all
            # n at once, when the last child finishes).
            outputs, finished = self.parent_req.get_outputs(self.request_id, completion)
            if not outputs:
                return None
            external_req_id = self.parent_req.external_req_id
        return RequestOutput(
            request_id=external_req_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=self.num_cached_tokens,
            metrics=self.stats,
            kv_transfer_params=kv_transfer_params,
        )

    def _new_completion_output(
        self,
        token_ids: list[int],
        finish_reason: FinishReason | None,
        stop_reason: int | str | None,
    ) -> CompletionOutput:
        finished = finish_reason is not None
        delta = self.output_kind == RequestOutputKind.DELTA
        text = self.detokenizer.get_next_output_text(finished, delta)
        if not delta:
            token_ids = self.detokenizer.token_ids
        logprobs = self.logprobs_processor.logprobs
        if delta and logprobs:
            logprobs = logprobs[-len(token_ids) :] if token_ids else []
        return CompletionOutput(
            index=self.request_index,
            text=text,
            token_ids=list(token_ids),
            cumulative_logprob=self.logprobs_processor.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=str(finish_reason) if finished else None,
            stop_reason=stop_reason if finished else None,
        )

    def whole_completion(self, finish_reason: FinishReason) -> CompletionOutput:
        """The whole completion, whatever the output kind (for the request's span)."""
        return CompletionOutput(
            index=self.request_index,
            text=self.detokenizer.output_text,
            token_ids=list(self.detokenizer.token_ids),
            cumulative_logprob=self.logprobs_processor.cumulative_logprob,
            logprobs=None,
            finish_reason=str(finish_reason),
        )


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput]
    # Requests the frontend finished (stop strings): the core must abort them.
    reqs_to_abort: list[str]


class OutputProcessor:
    """Process EngineCoreOutputs into RequestOutputs."""

    def __init__(self, tokenizer: Any, log_stats: bool = True) -> None:
        self.tokenizer = tokenizer
        self.log_stats = log_stats
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}
        # The user's id -> the internal ids of its requests (several for a
        # reused id, or for the n children of a parent).
        self.external_req_ids: defaultdict[str, list[str]] = defaultdict(list)

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def has_unfinished_requests(self) -> bool:
        return len(self.request_states) > 0

    def propagate_error(self, e: Exception) -> None:
        """Hand an engine error to every waiting generate() (AsyncLLM), and
        end every live request's span with it (status ERROR)."""
        for state in self.request_states.values():
            if state.queue is not None:
                state.queue.put(e)
            if state.span is not None:
                state.span.fail(e)

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        parent_req: ParentRequest | None = None,
        request_index: int = 0,
        queue: RequestOutputCollector | None = None,
    ) -> None:
        request_id = request.request_id
        if request_id in self.request_states:
            raise ValueError(f"Request id {request_id} already running.")
        req_state = RequestState(self.tokenizer, request, prompt, parent_req, request_index, queue)
        self.request_states[request_id] = req_state
        if parent_req is not None:
            self.parent_requests[parent_req.request_id] = parent_req
        self.external_req_ids[req_state.external_req_id].append(request_id)

    def abort_requests(
        self,
        request_ids: Iterable[str],
        internal: bool,
        iteration_stats: IterationStats | None = None,
    ) -> list[str]:
        """Forget these requests; return the internal ids the core must abort.

        ``internal=False``: the user's ids, each standing for every request
        sent under it. Internal ids may name a parent, which stands for its
        children. A request that is already gone is skipped. With
        ``iteration_stats``, each aborted request is counted as finished
        (``FinishReason.ABORT``), which vLLM 0.22.0 leaves out.
        """
        internal_req_ids: list[str] = []
        for request_id in request_ids:
            if internal:
                internal_req_ids.append(request_id)
            else:
                internal_req_ids.extend(self.external_req_ids.pop(request_id, []))
        request_ids_to_abort: list[str] = []
        for request_id in internal_req_ids:
            if (req_state := self.request_states.get(request_id)) is not None:
                self._finish_request(req_state)
                request_ids_to_abort.append(request_id)
                self._update_stats_from_finished(req_state, FinishReason.ABORT, iteration_stats)
                if req_state.queue is not None:
                    # AsyncLLM: a final output tells generate() it was aborted.
                    output = req_state.make_request_output([], FinishReason.ABORT, None)
                    if output is not None:
                        req_state.queue.put(output)
                self.do_tracing(req_state, FinishReason.ABORT)
            elif parent := self.parent_requests.pop(request_id, None):
                children = self.abort_requests(
                    list(parent.child_requests), internal=True, iteration_stats=iteration_stats
                )
                request_ids_to_abort.extend(children)
        return request_ids_to_abort

    # --8<-- [start:process_outputs]
    @tracing.instrument(
        "OutputProcessor.process_outputs",
        parent=records.process_outputs_parent,
        record=records.process_outputs,
    )
    def process_outputs(
        self,
        engine_core_outputs: list[EngineCoreOutput],
        engine_core_timestamp: float | None = None,
        iteration_stats: IterationStats | None = None,
    ) -> OutputProcessorOutput:
        """One pass over the step's outputs: stats, detokenize, stop, make outputs.

        The only loop over the batch's outputs (vLLM's rule): whatever must
        touch every request is done inside it.
        """
        request_outputs: list[RequestOutput] = []
        reqs_to_abort: list[str] = []
        for engine_core_output in engine_core_outputs:
            req_id = engine_core_output.request_id
            req_state = self.request_states.get(req_id)
            if req_state is None:
                # Aborted in the frontend while the core was still running it.
                continue

            # 1) Stats for this iteration.
            self._update_stats_from_output(
                req_state, engine_core_output, engine_core_timestamp, iteration_stats
            )
            new_token_ids = engine_core_output.new_token_ids
            finish_reason = engine_core_output.finish_reason
            stop_reason = engine_core_output.stop_reason
            if req_state.is_prefilling:
                if engine_core_output.prefill_stats is not None:
                    req_state.num_cached_tokens = engine_core_output.prefill_stats.num_cached_tokens
                req_state.is_prefilling = False

            # 2) Detokenize, then check stop strings.
            stop_string, num_taken = req_state.detokenizer.update_until_stop(
                new_token_ids, finish_reason == FinishReason.STOP
            )
            if stop_string:
                finish_reason = FinishReason.STOP
                stop_reason = stop_string
            new_logprobs = engine_core_output.new_logprobs
            if num_taken < len(new_token_ids):
                # Drafts accepted past the stop string: not output (see detokenizer.py).
                self._drop_tokens(req_state, len(new_token_ids) - num_taken, iteration_stats)
                new_token_ids = new_token_ids[:num_taken]
                if new_logprobs is not None:
                    new_logprobs = new_logprobs.slice_request(0, num_taken)

            # 3) Logprobs of the new tokens.
            req_state.logprobs_processor.update_from_output(new_logprobs)

            # 4) The RequestOutput: to AsyncLLM's collector, or returned.
            if request_output := req_state.make_request_output(
                new_token_ids, finish_reason, stop_reason, engine_core_output.kv_transfer_params
            ):
                if req_state.queue is not None:
                    req_state.queue.put(request_output)
                else:
                    request_outputs.append(request_output)

            # Free completed requests.
            if finish_reason is not None:
                self._finish_request(req_state)
                if not engine_core_output.finished:
                    # Finished here (a stop string): the core is still running it.
                    reqs_to_abort.append(req_id)
                self._update_stats_from_finished(req_state, finish_reason, iteration_stats)
                self.do_tracing(req_state, finish_reason)
        return OutputProcessorOutput(request_outputs, reqs_to_abort)

    # --8<-- [end:process_outputs]

    def _finish_request(self, req_state: RequestState) -> None:
        req_id = req_state.request_id
        self.request_states.pop(req_id)
        internal_ids = self.external_req_ids.get(req_state.external_req_id, [])
        if req_id in internal_ids:
            internal_ids.remove(req_id)
            if not internal_ids:
                del self.external_req_ids[req_state.external_req_id]
        parent_req = req_state.parent_req
        if parent_req is not None:
            parent_req.child_requests.discard(req_id)
            if not parent_req.child_requests:
                self.parent_requests.pop(parent_req.request_id, None)

    # --8<-- [start:do_tracing]
    def do_tracing(self, req_state: RequestState, finish_reason: FinishReason) -> None:
        """End the request's ``llm_request`` span (for n > 1: after the last child)."""
        if req_state.span is None:
            return
        req_state.span.finish_child(
            req_state.whole_completion(finish_reason),
            req_state.sampling_params,
            req_state.stats,
            len(req_state.prompt_token_ids),
            req_state.num_cached_tokens,
        )

    # --8<-- [end:do_tracing]

    def _update_stats_from_output(
        self,
        req_state: RequestState,
        engine_core_output: EngineCoreOutput,
        engine_core_timestamp: float | None,
        iteration_stats: IterationStats | None,
    ) -> None:
        if req_state.span is not None and engine_core_output.new_token_ids:
            req_state.span.token_times.append(engine_core_timestamp or 0.0)
        if iteration_stats is None:
            return
        assert engine_core_timestamp is not None
        iteration_stats.update_from_output(
            engine_core_output, engine_core_timestamp, req_state.is_prefilling, req_state.stats
        )

    def _drop_tokens(
        self, req_state: RequestState, num_dropped: int, iteration_stats: IterationStats | None
    ) -> None:
        """Uncount tokens the core sent after a stop string: decoding one
        token per step would never have made them."""
        if iteration_stats is not None:
            iteration_stats.num_generation_tokens -= num_dropped
            req_state.stats.num_generation_tokens -= num_dropped

    def _update_stats_from_finished(
        self,
        req_state: RequestState,
        finish_reason: FinishReason,
        iteration_stats: IterationStats | None,
    ) -> None:
        if iteration_stats is None:
            return
        iteration_stats.update_from_finished_request(
            finish_reason=finish_reason,
            request_id=req_state.external_req_id,
            num_prompt_tokens=len(req_state.prompt_token_ids),
            max_tokens_param=req_state.max_tokens_param,
            req_stats=req_state.stats,
            num_cached_tokens=req_state.num_cached_tokens,
        )
        ParentRequest.observe_finished_request(
            req_state.parent_req, iteration_stats, req_state.stats.num_generation_tokens
        )
