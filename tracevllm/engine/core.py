"""EngineCore: the loop that schedules, runs the model and returns tokens.

Mirrors vllm/v1/engine/core.py. ``EngineCore`` is the engine itself (used
in-process by ``InprocClient``); ``EngineCoreProc`` wraps it in its own process
behind ZeroMQ, with an input thread and an output thread around
``run_busy_loop``. Left out: the async-scheduling batch queue
(``step_with_batch_queue``), data parallelism, structured output, KV
connectors, sleep/wake and elastic scaling. The start-up handshake is folded
into one READY message on the input socket (vLLM uses a separate handshake
socket with HELLO → addresses → READY).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
import zmq
from opentelemetry import trace

from tracevllm import tracing
from tracevllm.config import VllmConfig
from tracevllm.core.kv_cache_utils import (
    BlockHash,
    get_hash_fn_by_name,
    get_request_block_hasher,
    init_none_hash,
)
from tracevllm.core.sched.scheduler import Scheduler
from tracevllm.engine import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    UtilityOutput,
)
from tracevllm.executor.abstract import Executor, UniProcExecutor
from tracevllm.request import Request, RequestStatus
from tracevllm.serial_utils import MsgpackDecoder, MsgpackEncoder

logger = logging.getLogger(__name__)

# Sent on the output socket when the engine dies of an error (vLLM's name).
ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"
READY = b"READY"


class EngineCoreReadyResponse(msgspec.Struct, array_like=True):  # type: ignore[call-arg]
    """What the engine reports once it has loaded the model and sized the KV cache."""

    max_model_len: int
    num_gpu_blocks: int
    pid: int


class EngineCore:
    """Inner loop of tracevllm's engine: one ``step()`` is one model forward."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        executor_class: type[Executor] = UniProcExecutor,
        log_stats: bool = True,
    ) -> None:
        self.vllm_config = vllm_config
        self.model_executor = executor_class(vllm_config)
        num_gpu_blocks = self._initialize_kv_caches(vllm_config)
        vllm_config.cache_config.num_gpu_blocks = num_gpu_blocks
        self.scheduler = Scheduler(vllm_config, log_stats=log_stats)

        # Block hashes are computed as requests arrive (and as tokens are
        # appended), so the scheduler only compares them.
        self.request_block_hasher: Callable[[Request], list[BlockHash]] | None = None
        # Trace context the step spans join (see _step_span).
        self._step_trace_headers: Mapping[str, str] | None = None
        cache_config = vllm_config.cache_config
        if cache_config.enable_prefix_caching:
            hash_fn = get_hash_fn_by_name(cache_config.prefix_caching_hash_algo)
            init_none_hash(hash_fn)
            self.request_block_hasher = get_request_block_hasher(cache_config.block_size, hash_fn)

    # --8<-- [start:initialize_kv_caches]
    def _initialize_kv_caches(self, vllm_config: VllmConfig) -> int:
        """Size the paged KV cache and allocate it in the model runner.

        num_blocks = available memory // bytes of one block across all layers,
        unless ``num_gpu_blocks_override`` fixes it.
        """
        cache_config = vllm_config.cache_config
        if cache_config.num_gpu_blocks_override is not None:
            num_blocks = cache_config.num_gpu_blocks_override
        else:
            page_size = self.model_executor.get_kv_cache_page_size_bytes()
            num_blocks = self.model_executor.determine_available_memory() // page_size
        max_len = vllm_config.model_config.get_max_model_len()
        logger.info("KV cache: %d blocks of %d tokens", num_blocks, cache_config.block_size)
        if num_blocks < 2:
            raise ValueError(
                f"The KV cache has room for {num_blocks} blocks; at least 2 are needed "
                "(block 0 is reserved). Raise kv_cache_memory_bytes or lower max_model_len "
                f"(now {max_len})."
            )
        self.model_executor.initialize_kv_cache(num_blocks)
        return num_blocks

    # --8<-- [end:initialize_kv_caches]

    # --- requests ---------------------------------------------------------
    def preprocess_add_request(self, request: EngineCoreRequest) -> Request:
        """Turn the wire request into the core's ``Request`` (hashes computed here).

        In EngineCoreProc this runs on the input thread, off the busy loop.
        """
        return Request.from_engine_core_request(request, self.request_block_hasher)

    def add_request(self, request: Request) -> None:
        """Hand a request to the scheduler's waiting queue.

        Its span's parent is the frontend's ``llm_request`` span, carried over
        the process boundary in ``trace_headers``.
        """
        if not tracing.is_enabled():
            self.scheduler.add_request(request)
            return
        with tracing.get_tracer().start_as_current_span(
            "EngineCore.add_request",
            context=tracing.extract_trace_context(request.trace_headers),
            attributes={
                **_ADD_REQUEST_CODE,
                "gen_ai.request.id": request.request_id,
                "tracevllm.num_prompt_tokens": request.num_prompt_tokens,
                "tracevllm.num_block_hashes": len(request.block_hashes),
            },
        ):
            self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    # --- the step -----------------------------------------------------------
    # --8<-- [start:step]
    def step(self) -> tuple[dict[int, EngineCoreOutputs], bool]:
        """Schedule, execute, and make output.

        Returns the outputs per client and whether the model ran.
        """
        if not self.scheduler.has_requests():
            return {}, False
        with self._step_span() as span:
            scheduler_output = self.scheduler.schedule()
            model_output = self.model_executor.execute_model(scheduler_output)
            if model_output is None:
                model_output = self.model_executor.sample_tokens()
            engine_core_outputs = self.scheduler.update_from_output(scheduler_output, model_output)
            if span.is_recording():
                self._link_step_to_requests(span, scheduler_output.num_scheduled_tokens)
        return engine_core_outputs, scheduler_output.total_num_scheduled_tokens > 0

    # --8<-- [end:step]

    # --8<-- [start:step_span]
    def _step_span(self) -> Any:
        """The ``EngineCore.step`` span, in the trace of the oldest request.

        A step serves many requests but a span has one parent: it joins the
        oldest request's trace and links to every request it served.
        """
        if not tracing.is_enabled():
            return trace.use_span(trace.INVALID_SPAN)
        oldest = next(iter(self.scheduler.running), None)
        if oldest is None and self.scheduler.waiting:
            oldest = self.scheduler.waiting.peek_request()
        if oldest is not None and oldest.trace_headers:
            self._step_trace_headers = oldest.trace_headers
        # A step with no live request (it only tells the runner what finished)
        # stays in the trace of the request served last.
        headers = self._step_trace_headers
        return tracing.get_tracer().start_as_current_span(
            "EngineCore.step",
            context=tracing.extract_trace_context(headers),
            attributes=_STEP_CODE,
        )

    # --8<-- [end:step_span]

    def _link_step_to_requests(self, span: trace.Span, scheduled: dict[str, int]) -> None:
        for req_id in scheduled:
            request = self.scheduler.requests.get(req_id)
            context = tracing.extract_trace_context(request.trace_headers if request else None)
            if context is None:
                continue
            req_span_context = trace.get_current_span(context).get_span_context()
            span.add_link(req_span_context, {"gen_ai.request.id": req_id})
        span.set_attribute(tracing.SpanAttributes.REQUEST_IDS, list(scheduled))

    def step_fn(self) -> tuple[dict[int, EngineCoreOutputs], bool]:
        return self.step()

    def post_step(self, model_executed: bool) -> None:
        # Speculative decoding would collect draft tokens here.
        pass

    # --- utilities (called by name from the client) -------------------------
    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def get_kv_cache_stats(self) -> dict[str, int]:
        """Block counts, for tests and views: free + in use == total."""
        pool = self.scheduler.kv_cache_manager.block_pool
        total = pool.get_num_usable_blocks()
        free = pool.get_num_free_blocks()
        return {"total": total, "free": free, "used": total - free}

    def shutdown(self) -> None:
        self.model_executor.shutdown()
        self.scheduler.shutdown()


# Where EngineCore's hand-made spans point (the methods above read these globals).
_ADD_REQUEST_CODE = tracing.code_attributes(EngineCore.add_request)
_STEP_CODE = tracing.code_attributes(EngineCore.step)


class EngineCoreProc(EngineCore):
    """EngineCore in its own process, talking ZeroMQ to the frontend."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        input_address: str,
        output_address: str,
        engine_index: int = 0,
        log_stats: bool = True,
    ) -> None:
        self.input_queue: queue.Queue[tuple[EngineCoreRequestType, Any]] = queue.Queue()
        self.output_queue: queue.Queue[tuple[int, EngineCoreOutputs] | bytes] = queue.Queue()
        self.engine_index = engine_index
        # Little-endian 2-byte identity, as vLLM's DEALER.
        self.identity = engine_index.to_bytes(length=2, byteorder="little")
        super().__init__(vllm_config, log_stats=log_stats)

        self.ctx = zmq.Context()
        # Both threads are daemons: the busy loop owns the process's lifetime.
        self.input_thread = threading.Thread(
            target=self.process_input_sockets,
            args=(input_address,),
            name="EngineCoreInputThread",
            daemon=True,
        )
        self.output_thread = threading.Thread(
            target=self.process_output_sockets,
            args=(output_address,),
            name="EngineCoreOutputThread",
            daemon=True,
        )
        self._ready = threading.Event()
        self.input_thread.start()
        self.output_thread.start()
        self._ready.wait()

    @staticmethod
    def run_engine_core(*args: Any, **kwargs: Any) -> None:
        """Entry point of the engine process (the target of multiprocessing).

        Its own TracerProvider is made here, in the child, and flushed in
        ``finally`` (multiprocessing exits children with os._exit, which skips
        atexit hooks).
        """
        # SIGTERM/SIGINT become an orderly exit, so `finally` runs and the
        # tracer provider is flushed.
        shutdown_requested = False

        def signal_handler(signum: int, frame: Any) -> None:
            nonlocal shutdown_requested
            if not shutdown_requested:
                shutdown_requested = True
                raise SystemExit()

        signal.signal(signal.SIGTERM, signal_handler)
        signal.signal(signal.SIGINT, signal_handler)
        engine_core: EngineCoreProc | None = None
        vllm_config: VllmConfig = kwargs["vllm_config"]
        tracing.init_tracer(
            "engine_core", vllm_config.trace_config, vllm_config.observability_config
        )
        try:
            engine_core = EngineCoreProc(*args, **kwargs)
            engine_core.run_busy_loop()
        except SystemExit:
            logger.debug("EngineCore exiting.")
        except Exception:
            logger.exception("EngineCore encountered a fatal error.")
            if engine_core is not None:
                engine_core._send_engine_dead()
            raise
        finally:
            if engine_core is not None:
                engine_core.shutdown()
            tracing.shutdown_tracer()

    # --8<-- [start:run_busy_loop]
    def run_busy_loop(self) -> None:
        """Core busy loop: take in new requests, then step the engine."""
        while True:
            if not self._process_input_queue():
                return
            self._process_engine_step()

    def _process_input_queue(self) -> bool:
        """Block while there is nothing to do, then drain the queue.

        Returns False when the engine should stop (the frontend is gone).
        """
        while not self.scheduler.has_requests():
            req = self.input_queue.get()
            if not self._handle_client_request(*req):
                return False
        while not self.input_queue.empty():
            if not self._handle_client_request(*self.input_queue.get_nowait()):
                return False
        return True

    def _process_engine_step(self) -> bool:
        outputs, model_executed = self.step_fn()
        for output in outputs.items():
            self.output_queue.put_nowait(output)
        self.post_step(model_executed)
        return model_executed

    # --8<-- [end:run_busy_loop]

    def _handle_client_request(self, request_type: EngineCoreRequestType, request: Any) -> bool:
        if request_type == EngineCoreRequestType.ADD:
            self.add_request(request)
        elif request_type == EngineCoreRequestType.ABORT:
            self.abort_requests(request)
        elif request_type == EngineCoreRequestType.UTILITY:
            client_index, call_id, method_name, args = request
            output = UtilityOutput(call_id)
            try:
                output.result = getattr(self, method_name)(*args)
            except Exception as e:
                logger.exception("Utility call %s failed", method_name)
                output.failure_message = f"Call to {method_name} method failed: {e}"
            self.output_queue.put_nowait((client_index, EngineCoreOutputs(utility_output=output)))
        elif request_type == EngineCoreRequestType.EXECUTOR_FAILED:
            # The input thread saw the frontend vanish.
            return False
        return True

    # --8<-- [start:process_input_sockets]
    def process_input_sockets(self, input_address: str) -> None:
        """Input thread: decode frames into ``input_queue``.

        Also watches the parent process: if the frontend dies without a word
        (SIGKILL), the engine must not live on as an orphan.
        """
        add_decoder = MsgpackDecoder(EngineCoreRequest)
        generic_decoder = MsgpackDecoder()
        parent = multiprocessing.parent_process()
        with self.ctx.socket(zmq.DEALER) as socket:
            socket.setsockopt(zmq.IDENTITY, self.identity)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(input_address)
            poller = zmq.Poller()
            poller.register(socket, zmq.POLLIN)
            if parent is not None:
                poller.register(parent.sentinel, zmq.POLLIN)
            # READY: tell the frontend what it needs to validate requests.
            ready = EngineCoreReadyResponse(
                max_model_len=self.vllm_config.model_config.get_max_model_len(),
                num_gpu_blocks=self.vllm_config.cache_config.num_gpu_blocks or 0,
                pid=os.getpid(),
            )
            socket.send_multipart((READY, MsgpackEncoder().encode(ready)))
            self._ready.set()
            while True:
                events = dict(poller.poll())
                if parent is not None and parent.sentinel in events:
                    self.input_queue.put_nowait((EngineCoreRequestType.EXECUTOR_FAILED, None))
                    return
                if socket not in events:
                    continue
                type_frame, *data_frames = socket.recv_multipart(copy=False)
                request_type = EngineCoreRequestType(bytes(type_frame.buffer))
                request: Any
                if request_type == EngineCoreRequestType.ADD:
                    request = self.preprocess_add_request(add_decoder.decode(data_frames))
                else:
                    request = generic_decoder.decode(data_frames)
                self.input_queue.put_nowait((request_type, request))

    # --8<-- [end:process_input_sockets]

    def process_output_sockets(self, output_address: str) -> None:
        """Output thread: encode and PUSH whatever the busy loop produced."""
        encoder = MsgpackEncoder()
        with self.ctx.socket(zmq.PUSH) as socket:
            socket.setsockopt(zmq.LINGER, 4000)
            socket.connect(output_address)
            while True:
                output = self.output_queue.get()
                if output == ENGINE_CORE_DEAD:
                    socket.send(ENGINE_CORE_DEAD)
                    return
                assert isinstance(output, tuple)
                client_index, outputs = output
                outputs.engine_index = self.engine_index
                socket.send(encoder.encode(outputs))

    def _send_engine_dead(self) -> None:
        self.output_queue.put_nowait(ENGINE_CORE_DEAD)
        # Give the output thread a moment to deliver it.
        deadline = time.monotonic() + 5.0
        while self.output_thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)

    def shutdown(self) -> None:
        # The ZeroMQ context is left to the process exit: the daemon I/O
        # threads are still polling its sockets, and closing them from this
        # thread can hang. The socket files belong to the frontend, which
        # removes them.
        super().shutdown()
