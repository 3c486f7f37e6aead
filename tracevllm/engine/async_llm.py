"""AsyncLLM: the engine for a server, where many requests stream at once.

Mirrors vllm/v1/engine/async_llm.py (``AsyncLLM``): ``generate()`` is an async
generator per request; ``add_request`` registers the request with the
``OutputProcessor`` under a ``RequestOutputCollector`` and sends it to
EngineCore through ``AsyncMPClient``; one background task, the output
handler, pulls every batch of outputs from EngineCore, turns them into
``RequestOutput``s and puts each into its request's collector, where its
``generate()`` is waiting. A ``generate()`` that is cancelled (the client hung
up) aborts its request, which frees its KV blocks in the core. Left out:
pooling (``encode``), LoRA, streaming input, pause/resume, sleep, the
profiler. With ``data_parallel_size`` D > 1 the client is
``DPLBAsyncMPClient`` (D engines, the DP coordinator, least-loaded routing).

Make it inside the event loop that will use it (``from_engine_args`` in an
``async`` function): its ZeroMQ sockets and its output handler belong to
that loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Iterable, Mapping
from typing import Any

from tracevllm import envs, tracing
from tracevllm.config import ModelConfig, VllmConfig
from tracevllm.engine import EngineCoreRequest
from tracevllm.engine.arg_utils import EngineArgs
from tracevllm.engine.core_client import AsyncMPClient, EngineCoreClient
from tracevllm.engine.exceptions import EngineDeadError, EngineGenerateError
from tracevllm.engine.input_processor import InputProcessor, PromptType, request_prompt_text
from tracevllm.engine.llm_engine import load_tokenizer
from tracevllm.engine.output_processor import OutputProcessor, RequestOutputCollector
from tracevllm.engine.parallel_sampling import ParentRequest
from tracevllm.logger import init_logger
from tracevllm.metrics.loggers import StatLoggerBase
from tracevllm.metrics.stats import IterationStats
from tracevllm.outputs import RequestOutput
from tracevllm.sampling_params import SamplingParams
from tracevllm.tracing import records
from tracevllm.tracing.kv_transfer import kv_transfer_trace_headers
from tracevllm.tracing.request_span import llm_request_span, record_request_error

logger = init_logger(__name__)

# Outputs processed between two yields to the event loop (vLLM's
# VLLM_V1_OUTPUT_PROC_CHUNK_SIZE default).
OUTPUT_PROC_CHUNK_SIZE = 128


async def _get_output_or_warn(engine_core: AsyncMPClient, output_processor: Any) -> Any:
    """The next outputs; while requests wait on a silent engine (stopped,
    stuck), say so every TRACEVLLM_ENGINE_ITERATION_TIMEOUT_S, as LLMEngine does."""
    waited = 0.0
    while True:
        timeout = envs.TRACEVLLM_ENGINE_ITERATION_TIMEOUT_S
        try:
            return await asyncio.wait_for(engine_core.get_output_async(), timeout)
        except TimeoutError:
            if not output_processor.has_unfinished_requests():
                waited = 0.0  # idle, not hung
                continue
            waited += timeout
            logger.warning(
                "No output from EngineCore (pid %s) for %.0f s while %d requests are in "
                "flight: it may be stopped (SIGSTOP), swapping or stuck.",
                engine_core.engine_pid,
                waited,
                output_processor.get_num_unfinished_requests(),
            )


class AsyncLLM:
    """An asyncio engine client: many concurrent ``generate()`` streams."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        log_stats: bool = True,
        stat_loggers: list[StatLoggerBase] | None = None,
    ) -> None:
        self.vllm_config = vllm_config
        self.model_config: ModelConfig = vllm_config.model_config
        self.log_stats = log_stats
        self.stat_loggers = list(stat_loggers or [])
        self.tracer_provider = tracing.init_tracer(
            "frontend", vllm_config.trace_config, vllm_config.observability_config
        )
        # EngineCore first: its process forks before this one loads anything heavy.
        self.engine_core: AsyncMPClient = EngineCoreClient.make_async_mp_client(vllm_config)
        try:
            assert self.model_config.tokenizer is not None
            self.tokenizer = load_tokenizer(self.model_config.tokenizer)
            self.input_processor = InputProcessor(vllm_config, self.tokenizer)
            self.input_processor.num_gpu_blocks = self.engine_core.num_gpu_blocks
            self.input_processor.kv_cache_block_limits = self.engine_core.kv_cache_block_limits
            self.output_processor = OutputProcessor(self.tokenizer, log_stats=log_stats)
        except BaseException:
            self.shutdown()
            raise
        self.output_handler: asyncio.Task[None] | None = None
        self._run_output_handler()

    @classmethod
    def from_engine_args(
        cls,
        engine_args: EngineArgs,
        stat_loggers: list[StatLoggerBase] | None = None,
    ) -> AsyncLLM:
        return cls(engine_args.create_engine_config(), stat_loggers=stat_loggers)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    async def is_tracing_enabled(self) -> bool:
        return tracing.is_enabled()

    # --8<-- [start:async_add_request]
    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        trace_headers: Mapping[str, str] | None = None,
        priority: int = 0,
    ) -> RequestOutputCollector:
        """Validate, register and send one request; its outputs will come to
        the returned collector (for n > 1: all n children's).

        With tracing on, the request's ``llm_request`` span starts here and
        its context travels in ``trace_headers``.
        """
        if self.errored:
            raise EngineDeadError()
        arrival_time = arrival_time if arrival_time is not None else time.time()
        n = params.n if isinstance(params, SamplingParams) else 1
        remote = kv_transfer_trace_headers(params)  # a KV producer's trace, continued
        with llm_request_span(request_id, arrival_time, n, trace_headers, remote) as trace_headers:
            request = self.input_processor.process_inputs(
                request_id, prompt, params, arrival_time, trace_headers, priority
            )
            self.input_processor.assign_request_id(request)
            queue = RequestOutputCollector(params.output_kind, request.request_id)
            prompt_text = request_prompt_text(prompt)
            # The params process_inputs cloned and completed.
            params = request.sampling_params
            if params.n == 1:
                await self._add_request(request, prompt_text, None, 0, queue)
                return queue
            # Fan out: n children, one collector.
            parent_request = ParentRequest(request)
            try:
                for idx in range(params.n):
                    child = parent_request.child_request(request, idx)
                    await self._add_request(child, prompt_text, parent_request, idx, queue)
                    if idx % 64 == 63:
                        await asyncio.sleep(0)  # a huge n must not hold the event loop
            except BaseException:
                await self.abort(request.request_id, internal=True)
                raise
            return queue

    @tracing.instrument("AsyncLLM._add_request")
    async def _add_request(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        parent_req: ParentRequest | None,
        index: int,
        queue: RequestOutputCollector,
    ) -> None:
        """Register the request with the OutputProcessor, then send it to
        EngineCore; if the send fails, abort it (it may have gone)."""
        # Registered first, so no output can arrive for an unknown request.
        self.output_processor.add_request(request, prompt, parent_req, index, queue)
        try:
            await self.engine_core.add_request_async(request)
        except BaseException as e:
            # On the request's span first: the abort ends it.
            record_request_error(request.trace_headers, e)
            request_ids = self.output_processor.abort_requests([request.request_id], internal=True)
            # The send's own failure is the one to report, not the abort's.
            with contextlib.suppress(Exception):
                await self.engine_core.abort_requests_async(request_ids)
            raise

    # --8<-- [end:async_add_request]

    # --8<-- [start:async_generate]
    @tracing.instrument("AsyncLLM.generate", parent=records.generate_parent)
    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        trace_headers: Mapping[str, str] | None = None,
        priority: int = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Add the request, then yield its outputs as the output handler
        delivers them, until the last one.

        If the caller stops reading (a client disconnect cancels its task),
        the request is aborted here, which frees its KV blocks in the core.
        Raises ``EngineDeadError`` if the engine died, ``ValueError`` or
        ``TypeError`` for a bad request, and ``EngineGenerateError`` (from
        the cause) if anything else failed this request.
        """
        q: RequestOutputCollector | None = None
        try:
            q = await self.add_request(
                request_id, prompt, sampling_params, trace_headers=trace_headers, priority=priority
            )
            finished = False
            while not finished:
                # Drain without awaiting when an output is there already.
                out = q.get_nowait() or await q.get()
                finished = out.finished
                yield out
        except (asyncio.CancelledError, GeneratorExit):
            if q is not None:
                await self.abort(q.request_id, internal=True)
            logger.info("Request %s aborted.", request_id)
            raise
        except EngineDeadError:
            logger.info("Request %s failed (engine dead).", request_id)
            raise
        except (ValueError, TypeError, OverflowError) as e:
            # A bad request (vLLM: ValueError; tracevllm's entry checks also
            # raise TypeError for a wrong type): the server's 400.
            logger.info("Request %s failed (bad request): %s.", request_id, e)
            raise
        except Exception as e:
            # Anything else failed this request only: the engine goes on.
            if q is not None:
                await self.abort(q.request_id, internal=True)
            logger.info("Request %s failed due to %s: %s.", request_id, type(e).__name__, e)
            raise EngineGenerateError() from e

    # --8<-- [end:async_generate]

    # --8<-- [start:output_handler]
    def _run_output_handler(self) -> None:
        """Background loop: pull from EngineCore, push to each request's collector.

        The task holds no reference to the AsyncLLM (only to what it uses),
        so the AsyncLLM can be garbage-collected and shut down.
        """
        if self.output_handler is not None:
            return
        engine_core, output_processor = self.engine_core, self.output_processor
        log_stats, stat_loggers = self.log_stats, self.stat_loggers

        async def output_handler() -> None:
            try:
                while True:
                    # 1) Pull EngineCoreOutputs from the EngineCore.
                    outputs = await _get_output_or_warn(engine_core, output_processor)
                    num_outputs = len(outputs.outputs)
                    iteration_stats = IterationStats() if log_stats and num_outputs else None
                    # 2) Process them, in chunks so that a huge batch does not
                    # hold the event loop: each RequestOutput goes to its collector.
                    for start in range(0, num_outputs, OUTPUT_PROC_CHUNK_SIZE):
                        end = start + OUTPUT_PROC_CHUNK_SIZE
                        processed = output_processor.process_outputs(
                            outputs.outputs[start:end], outputs.timestamp, iteration_stats
                        )
                        assert not processed.request_outputs
                        if end < num_outputs:
                            await asyncio.sleep(0)
                        # 3) Abort requests that finished on a stop string.
                        if processed.reqs_to_abort:
                            await engine_core.abort_requests_async(processed.reqs_to_abort)
                    # 4) Stats for /metrics.
                    for stat_logger in stat_loggers:
                        stat_logger.record(outputs.scheduler_stats, iteration_stats)
            except Exception as e:
                logger.exception("AsyncLLM output_handler failed.")
                # Every waiting generate() raises it (EngineDeadError if the
                # engine died), instead of waiting forever.
                output_processor.propagate_error(e)

        self.output_handler = asyncio.create_task(output_handler(), name="AsyncLLMOutputHandler")

    # --8<-- [end:output_handler]

    async def abort(self, request_id: str | Iterable[str], internal: bool = False) -> None:
        """Abort requests in the OutputProcessor and in EngineCore (which frees
        their KV blocks). User ids by default; ``internal=True`` for ids
        ``add_request`` made."""
        request_ids = [request_id] if isinstance(request_id, str) else list(request_id)
        # Aborted requests are finished ones for /metrics (vLLM 0.22.0 drops them).
        iteration_stats = IterationStats() if self.log_stats else None
        all_request_ids = self.output_processor.abort_requests(
            request_ids, internal, iteration_stats
        )
        if iteration_stats is not None and iteration_stats.finished_requests:
            for stat_logger in self.stat_loggers:
                stat_logger.record(None, iteration_stats)
        await self.engine_core.abort_requests_async(all_request_ids)

    async def check_health(self) -> None:
        if self.errored:
            raise self.dead_error

    async def reset_prefix_cache(self) -> bool:
        return bool(await self.engine_core.call_utility_async("reset_prefix_cache"))

    async def get_kv_cache_stats(self) -> dict[str, int]:
        return dict(await self.engine_core.call_utility_async("get_kv_cache_stats"))

    @property
    def is_running(self) -> bool:
        return self.output_handler is None or not self.output_handler.done()

    @property
    def errored(self) -> bool:
        return self.engine_core.resources.engine_dead or not self.is_running

    @property
    def dead_error(self) -> BaseException:
        return EngineDeadError()

    def shutdown(self) -> None:
        """Stop the engine process and the output handler; flush this process's spans."""
        if (engine_core := getattr(self, "engine_core", None)) is not None:
            engine_core.shutdown()
        if (handler := getattr(self, "output_handler", None)) is not None:
            handler.cancel()
        provider = getattr(self, "tracer_provider", None)
        if provider is not None and tracing.get_provider() is provider:
            tracing.shutdown_tracer()
        self.tracer_provider = None
