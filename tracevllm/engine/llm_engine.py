"""LLMEngine: the frontend's synchronous engine loop.

Mirrors vllm/v1/engine/llm_engine.py. ``add_request`` validates and tokenizes
(``InputProcessor``), registers the request with the ``OutputProcessor`` and
sends it to the engine core; ``step`` takes one batch of core outputs, turns
them into ``RequestOutput``s and aborts requests the frontend finished (stop
strings). With ``data_parallel_size`` D > 1 the client is ``DPLBSyncMPClient``:
D engine processes, each request sent to the least-loaded one, their outputs
merged. Left out: pooling, LoRA, the stat loggers.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from typing import Any

from tracevllm import envs, tracing
from tracevllm.config import ModelConfig, VllmConfig
from tracevllm.engine import EngineCoreRequest
from tracevllm.engine.arg_utils import EngineArgs
from tracevllm.engine.core_client import EngineCoreClient
from tracevllm.engine.input_processor import InputProcessor, PromptType, request_prompt_text
from tracevllm.engine.output_processor import OutputProcessor
from tracevllm.engine.parallel_sampling import ParentRequest
from tracevllm.logger import init_logger
from tracevllm.metrics.stats import IterationStats, SchedulerStats
from tracevllm.outputs import RequestOutput
from tracevllm.sampling_params import SamplingParams
from tracevllm.tracing.kv_transfer import kv_transfer_trace_headers
from tracevllm.tracing.request_span import llm_request_span, record_request_error

logger = init_logger(__name__)


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
        self.log_stats = True
        self.is_shut_down = False
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
            self.input_processor.kv_cache_block_limits = self.engine_core.kv_cache_block_limits
            self.output_processor = OutputProcessor(self.tokenizer, log_stats=self.log_stats)
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

    @property
    def model_config(self) -> ModelConfig:
        return self.vllm_config.model_config

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
    ) -> str:
        """Validate and send one request to the engine core (n > 1: n children).

        Returns the internal request id (the user's id plus a random suffix);
        outputs carry the user's id. With tracing on, the request's
        ``llm_request`` span starts here, at its arrival time, and its context
        travels in ``trace_headers``, so every span about it, in either
        process, joins one trace.
        """
        self._check_not_shut_down()
        arrival_time = arrival_time if arrival_time is not None else time.time()
        n = params.n if isinstance(params, SamplingParams) else 1
        remote = kv_transfer_trace_headers(params)  # a KV producer's trace, continued
        with llm_request_span(request_id, arrival_time, n, trace_headers, remote) as trace_headers:
            return self._add_request(
                request_id, prompt, params, arrival_time, trace_headers, priority
            )

    @tracing.instrument("LLMEngine.add_request")
    def _add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float,
        trace_headers: Mapping[str, str] | None,
        priority: int,
    ) -> str:
        request = self.input_processor.process_inputs(
            request_id, prompt, params, arrival_time, trace_headers, priority
        )
        self.input_processor.assign_request_id(request)
        prompt_text = request_prompt_text(prompt)
        params = request.sampling_params
        if params.n == 1:
            self._send(request, prompt_text, None, 0)
            return request.request_id
        # Fan out: the core sees n independent requests sharing one prompt.
        parent_req = ParentRequest(request)
        try:
            for idx in range(params.n):
                self._send(parent_req.child_request(request, idx), prompt_text, parent_req, idx)
        except BaseException:
            # One child could not be sent: take back the ones that were.
            self.abort_request([request.request_id], internal=True)
            raise
        return request.request_id

    def _send(
        self,
        request: EngineCoreRequest,
        prompt_text: str | None,
        parent_req: ParentRequest | None,
        index: int,
    ) -> None:
        """Register the request, then send it; if sending fails, abort it.

        Registered first, as in vLLM, so that no output can arrive for a
        request the output processor does not know; aborted on failure, so a
        request that never reached the core is never waited for, and one
        that did (a Ctrl-C that lands just after the send) does not run on.
        """
        self.output_processor.add_request(request, prompt_text, parent_req, index)
        try:
            self.engine_core.add_request(request)
        except BaseException as e:
            # On the request's span first: the abort ends it.
            record_request_error(request.trace_headers, e)
            request_ids = self.output_processor.abort_requests([request.request_id], internal=True)
            # The send's own failure is the one to report, not the abort's.
            with contextlib.suppress(Exception):
                self.engine_core.abort_requests(request_ids)
            raise

    # --8<-- [end:add_request]

    # --8<-- [start:engine_step]
    @tracing.instrument("LLMEngine.step")
    def step(self) -> list[RequestOutput]:
        """One engine step: outputs of the requests that advanced."""
        self._check_not_shut_down()
        # 1) Get EngineCoreOutputs (in-process: this runs the step itself).
        try:
            outputs = self.engine_core.get_output()
        except BaseException as e:
            if isinstance(e, Exception):
                # The engine failed (or died): every live request's span ends
                # with the error.
                self.output_processor.propagate_error(e)
            if not self.multiprocess_mode:
                # The in-process core aborted every request of the failed step
                # (InprocClient.get_output): no output will come for them.
                self.output_processor.abort_requests(
                    list(self.output_processor.request_states), internal=True
                )
            raise
        # 2) Detokenize, check stop strings, make RequestOutputs.
        iteration_stats = IterationStats() if self.log_stats else None
        processed = self.output_processor.process_outputs(
            outputs.outputs, outputs.timestamp, iteration_stats
        )
        # 3) Abort requests that finished here (stop strings) in the core too.
        self.engine_core.abort_requests(processed.reqs_to_abort)
        # 4) Record stats.
        if outputs.scheduler_stats is not None:
            self.last_scheduler_stats = outputs.scheduler_stats
            self.num_preemptions += outputs.scheduler_stats.num_preempted_reqs
        return processed.request_outputs

    # --8<-- [end:engine_step]

    def abort_request(self, request_ids: list[str], internal: bool = False) -> None:
        """Abort requests, by the user's ids (``internal=False``, each standing
        for every request sent under it and every child of an n > 1 request)
        or by the internal ids ``add_request`` returned."""
        request_ids = self.output_processor.abort_requests(request_ids, internal)
        self.engine_core.abort_requests(request_ids)

    def reset_prefix_cache(self) -> bool:
        self._check_not_shut_down()
        return self.engine_core.reset_prefix_cache()

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        self._check_not_shut_down()
        return self.engine_core.collective_rpc(method, timeout, args, kwargs)

    def _check_not_shut_down(self) -> None:
        if self.is_shut_down:
            raise RuntimeError(
                "This engine has been shut down (shutdown() was called, or its `with` "
                "block ended); create a new LLM to generate again."
            )

    def shutdown(self) -> None:
        """Stop the engine core, then flush this process's spans."""
        self.is_shut_down = True
        engine_core = getattr(self, "engine_core", None)
        if engine_core is not None:
            engine_core.shutdown()
        if self.tracer_provider is not None and tracing.get_provider() is self.tracer_provider:
            tracing.shutdown_tracer()
        self.tracer_provider = None
