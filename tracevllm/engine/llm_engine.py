"""LLMEngine: the frontend's synchronous engine loop.

Mirrors vllm/v1/engine/llm_engine.py. ``add_request`` validates and tokenizes
(``InputProcessor``), registers the request with the ``OutputProcessor`` and
sends it to the engine core; ``step`` takes one batch of core outputs, turns
them into ``RequestOutput``s and aborts requests the frontend finished (stop
strings). Left out: pooling, LoRA, data parallelism, the stat loggers.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping
from typing import Any

from opentelemetry import trace

from tracevllm import envs, tracing
from tracevllm.config import VllmConfig
from tracevllm.engine.arg_utils import EngineArgs
from tracevllm.engine.core_client import EngineCoreClient
from tracevllm.engine.input_processor import InputProcessor, PromptType
from tracevllm.engine.output_processor import OutputProcessor
from tracevllm.engine.parallel_sampling import ParentRequest
from tracevllm.metrics.stats import SchedulerStats
from tracevllm.outputs import RequestOutput
from tracevllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class LLMEngine:
    """Legacy-named synchronous engine (vLLM keeps the name for the V1 frontend)."""

    def __init__(self, vllm_config: VllmConfig, multiprocess_mode: bool | None = None) -> None:
        self.vllm_config = vllm_config
        if multiprocess_mode is None:
            multiprocess_mode = envs.TRACEVLLM_ENABLE_MULTIPROCESSING
        self.multiprocess_mode = multiprocess_mode
        # Running totals from each step's SchedulerStats (vLLM's Prometheus
        # counters keep the same): preemptions, and the latest stats.
        self.num_preemptions = 0
        self.last_scheduler_stats: SchedulerStats | None = None
        # This process's spans; the engine process makes its own provider. In
        # one process both sides share this one.
        self.tracer_provider = tracing.init_tracer(
            "frontend" if multiprocess_mode else "inprocess",
            vllm_config.trace_config,
            vllm_config.observability_config,
        )
        # The engine core starts first: its process forks before this one has
        # loaded anything heavy (see core_client._get_mp_method).
        self.engine_core = EngineCoreClient.make_client(multiprocess_mode, vllm_config)
        try:
            assert vllm_config.model_config.tokenizer is not None
            self.tokenizer = load_tokenizer(vllm_config.model_config.tokenizer)
            self.input_processor = InputProcessor(vllm_config, self.tokenizer)
            self.input_processor.num_gpu_blocks = self.engine_core.num_gpu_blocks
            self.output_processor = OutputProcessor(self.tokenizer)
        except BaseException:
            self.shutdown()
            raise

    @classmethod
    def from_engine_args(
        cls, engine_args: EngineArgs, multiprocess_mode: bool | None = None
    ) -> LLMEngine:
        if multiprocess_mode is None:
            multiprocess_mode = engine_args.enable_multiprocessing
        return cls(engine_args.create_engine_config(), multiprocess_mode)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    # --8<-- [start:add_request]
    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        trace_headers: Mapping[str, str] | None = None,
        priority: int = 0,
    ) -> None:
        """Validate and send one request to the engine core (n > 1: n children).

        With tracing on, the request's ``llm_request`` span starts here (at its
        arrival time) and its context travels in ``trace_headers``, so every
        span about it, in either process, joins one trace.
        """
        arrival_time = arrival_time if arrival_time is not None else time.time()
        span = None
        if tracing.is_enabled():
            span = tracing.get_tracer().start_span(
                "llm_request",
                context=tracing.extract_trace_context(trace_headers),
                kind=trace.SpanKind.SERVER,
                start_time=int(arrival_time * 1e9),
                attributes={tracing.SpanAttributes.GEN_AI_REQUEST_ID: request_id},
            )
            trace_headers = tracing.inject_trace_context(trace.set_span_in_context(span))
        try:
            with trace.use_span(span, end_on_exit=False) if span else contextlib.nullcontext():
                self._add_request(
                    request_id, prompt, params, arrival_time, trace_headers, priority, span
                )
        except BaseException as e:
            if span is not None:
                span.record_exception(e)
                span.set_status(trace.StatusCode.ERROR, str(e))
                span.end()
            raise

    @tracing.instrument("LLMEngine.add_request")
    def _add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float,
        trace_headers: Mapping[str, str] | None,
        priority: int,
        span: trace.Span | None,
    ) -> None:
        prompt_text, request = self.input_processor.process_inputs(
            request_id, prompt, params, arrival_time, trace_headers, priority
        )
        n = params.n
        if n == 1:
            self.output_processor.add_request(request, prompt_text, span=span)
            self.engine_core.add_request(request)
            return
        # Fan out: the core sees n independent requests sharing one prompt.
        parent_req = ParentRequest(request_id, request.sampling_params)
        for idx in range(n):
            child_id, child_params = parent_req.get_child_info(idx)
            child = type(request)(
                request_id=child_id,
                prompt_token_ids=request.prompt_token_ids,
                sampling_params=child_params,
                arrival_time=request.arrival_time,
                priority=request.priority,
                trace_headers=request.trace_headers,
            )
            self.output_processor.add_request(child, prompt_text, parent_req, idx, span=span)
            self.engine_core.add_request(child)

    # --8<-- [end:add_request]

    # --8<-- [start:engine_step]
    @tracing.instrument("LLMEngine.step")
    def step(self) -> list[RequestOutput]:
        """One engine step: outputs of the requests that advanced."""
        # 1) Get EngineCoreOutputs (in-process: this runs the step itself).
        outputs = self.engine_core.get_output()
        if outputs.scheduler_stats is not None:
            self.last_scheduler_stats = outputs.scheduler_stats
            self.num_preemptions += outputs.scheduler_stats.num_preempted_reqs
        # 2) Detokenize, check stop strings, make RequestOutputs.
        processed = self.output_processor.process_outputs(outputs.outputs, outputs.timestamp)
        # 3) Abort requests that finished here (stop strings) in the core too.
        self.engine_core.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs

    # --8<-- [end:engine_step]

    def abort_request(self, request_ids: list[str]) -> None:
        """Abort requests (parent ids of n > 1 requests abort every child)."""
        request_ids = self.output_processor.abort_requests(request_ids)
        self.engine_core.abort_requests(request_ids)

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the engine core, then flush this process's spans."""
        engine_core = getattr(self, "engine_core", None)
        if engine_core is not None:
            engine_core.shutdown()
        if self.tracer_provider is not None and tracing.get_provider() is self.tracer_provider:
            tracing.shutdown_tracer()
        self.tracer_provider = None
