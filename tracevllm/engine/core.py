"""EngineCore: the loop that schedules, runs the model and returns tokens.

Mirrors vllm/v1/engine/core.py. ``EngineCore`` is the engine itself (used
in-process by ``InprocClient``); ``EngineCoreProc`` wraps it in its own process
behind ZeroMQ, with an input thread and an output thread around
``run_busy_loop``. When the executor runs several batches at once
(``max_concurrent_batches`` > 1: P with pipeline parallelism, 2 with async
scheduling), the loop steps with ``step_with_batch_queue``, which keeps that
many steps in flight; with async scheduling the scheduler is the
``AsyncScheduler``, which schedules a request again before its last token
is known. Left out: KV connectors, sleep/wake and elastic scaling. The
start-up handshake is folded into one READY message on the input socket
(vLLM uses a separate handshake socket with HELLO → addresses → READY).
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import queue
import shutil
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any, cast

import msgspec
import zmq

from tracevllm import labs, tracing
from tracevllm.config import VllmConfig
from tracevllm.core.kv_cache_sizing import get_request_block_limits
from tracevllm.core.kv_cache_utils import (
    BlockHash,
    generate_scheduler_kv_cache_config,
    get_hash_fn_by_name,
    get_kv_cache_configs,
    get_request_block_hasher,
    init_none_hash,
)
from tracevllm.core.sched.output import SchedulerOutput
from tracevllm.core.sched.scheduler import Scheduler
from tracevllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown
from tracevllm.engine import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
    UtilityOutput,
)
from tracevllm.executor import Executor
from tracevllm.kv_cache_interface import KVCacheConfig
from tracevllm.logger import init_logger
from tracevllm.metrics.stats import SchedulerStats
from tracevllm.outputs import ModelRunnerOutput
from tracevllm.request import Request, RequestStatus
from tracevllm.serial_utils import MsgpackDecoder, MsgpackEncoder
from tracevllm.structured_output import StructuredOutputManager
from tracevllm.tracing import records
from tracevllm.tracing.attributes import SpanAttributes
from tracevllm.utils.gc_utils import freeze_gc_heap

logger = init_logger(__name__)
# How often an idle engine core wakes to let a signal's handler run (seconds).
IDLE_WAKEUP_S = 0.2
# How often a core with only KV transfers pending polls the connector
# (seconds): a transfer's end is seen at most this much later.
KV_TRANSFER_POLL_S = 0.01

# Sent on the output socket when the engine dies of an error (vLLM's name).
ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"
READY = b"READY"


def _remove_socket_dir(address: str) -> None:
    """Remove the frontend's private socket directory (``ipc://DIR/name``)."""
    if address.startswith("ipc://"):
        shutil.rmtree(os.path.dirname(address[len("ipc://") :]), ignore_errors=True)


# How long EngineCore may take to leave once its parent died during start-up
# (stopping its workers takes up to ~10 s) before it exits hard.
STARTUP_ORPHAN_GRACE_S = 30.0


def _watch_parent_during_startup(socket_address: str) -> Callable[[], None]:
    """Leave promptly if the frontend dies while this engine is starting.

    Once started, the input thread watches the parent (``process_input_sockets``);
    before, the main thread is busy loading the model, starting the workers
    and sizing the KV cache, which can take a minute. A thread waits on the
    parent's sentinel and, if the parent dies first, sends SIGTERM to the
    main thread (not the process: a blocking wait there must be woken), whose
    handler raises SystemExit: start-up unwinds, stopping the workers and
    releasing the queues on its way. Should the main thread be stuck where no
    signal reaches it, the process exits hard after STARTUP_ORPHAN_GRACE_S.
    tracevllm's own (vLLM's engine core does not watch its parent while it
    starts). Returns the function that ends the watch, called once started.
    """
    parent = multiprocessing.parent_process()
    if parent is None:
        return lambda: None
    sentinel = parent.sentinel
    stop_r, stop_w = os.pipe()
    main_thread_id = threading.main_thread().ident
    assert main_thread_id is not None

    def watch() -> None:
        try:
            ready = multiprocessing.connection.wait([sentinel, stop_r])
        finally:
            os.close(stop_r)
        if sentinel not in ready:
            return
        logger.warning("The frontend process is gone while EngineCore was starting: exiting.")
        signal.pthread_kill(main_thread_id, signal.SIGTERM)
        time.sleep(STARTUP_ORPHAN_GRACE_S)
        logger.warning("EngineCore did not leave within %.0f s; exiting.", STARTUP_ORPHAN_GRACE_S)
        _remove_socket_dir(socket_address)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="EngineCoreStartupParentWatch").start()
    return lambda: os.close(stop_w)


class EngineCoreReadyResponse(msgspec.Struct, array_like=True):  # type: ignore[call-arg]
    """What the engine reports once it has loaded the model and sized the KV cache."""

    max_model_len: int
    num_gpu_blocks: int
    pid: int
    # Per KV cache group: (block size, most blocks one request holds, 0: no
    # bound), for the entry's check that a request fits (get_request_block_limits).
    kv_cache_block_limits: list[tuple[int, int]]


class EngineCore:
    """Inner loop of tracevllm's engine: one ``step()`` is one model forward."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        executor_class: type[Executor] | None = None,
        log_stats: bool = True,
    ) -> None:
        self.vllm_config = vllm_config
        self.use_spec_decode = vllm_config.speculative_config is not None
        if executor_class is None:
            # vLLM's client passes it in; here the core asks for itself.
            executor_class = Executor.get_class(vllm_config)
        self.model_executor = executor_class(vllm_config)
        try:
            kv_cache_config = self._initialize_kv_caches(vllm_config)
            self.structured_output_manager = StructuredOutputManager(vllm_config)
            # Scheduler, or AsyncScheduler with async scheduling (vLLM's choice).
            scheduler_cls = vllm_config.scheduler_config.get_scheduler_cls()
            self.scheduler: Scheduler = scheduler_cls(
                vllm_config,
                log_stats=log_stats,
                structured_output_manager=self.structured_output_manager,
                kv_cache_config=kv_cache_config,
            )
        except BaseException:
            # tracevllm's: a start that fails here (a pool too small for one
            # request) shuts its workers down, which in-process gives back
            # what they took from the caller's process (threads, connector).
            # The start's own error is the one raised.
            try:
                self.model_executor.shutdown()
            except Exception:
                logger.exception("Shutting the workers down after a failed start failed too")
            raise
        self.kv_cache_block_limits = get_request_block_limits(vllm_config, kv_cache_config)

        # Block hashes are computed as requests arrive (and as tokens are
        # appended), so the scheduler only compares them.
        self.request_block_hasher: Callable[[Request], list[BlockHash]] | None = None
        cache_config = vllm_config.cache_config
        if cache_config.enable_prefix_caching:
            hash_fn = get_hash_fn_by_name(cache_config.prefix_caching_hash_algo)
            init_none_hash(hash_fn)
            self.request_block_hasher = get_request_block_hasher(cache_config.block_size, hash_fn)

        # --8<-- [start:batch_queue]
        # The batch queue: up to max_concurrent_batches steps in flight at
        # once (P with P pipeline stages, so that each stage has a batch to
        # run while the others run theirs; 2 with async scheduling, so that
        # the next step is scheduled while this one runs). One: the
        # synchronous step().
        self.batch_queue_size = self.model_executor.max_concurrent_batches
        self.batch_queue: (
            deque[tuple[Future[ModelRunnerOutput], SchedulerOutput, Future[Any]]] | None
        ) = None
        if self.batch_queue_size > 1:
            logger.debug("Batch queue is enabled with size %d", self.batch_queue_size)
            self.batch_queue = deque(maxlen=self.batch_queue_size)
        # --8<-- [end:batch_queue]
        self.async_scheduling = bool(vllm_config.scheduler_config.async_scheduling)
        # The most steps that were in flight at once, and what the last turn
        # of step_with_batch_queue did (tracevllm's: for tests and its span).
        self.max_batches_in_flight = 0
        self.batch_queue_info: dict[str, Any] = {}

        # Aborts that arrive while a step runs (EngineCoreProc's input thread
        # puts them here as well as in the input queue): applied before the
        # step's output is made, so an aborted request gets no more tokens.
        self.aborts_queue: queue.Queue[list[str]] = queue.Queue()

        # The startup heap (torch, the model, the KV cache's bookkeeping) stays
        # alive until shutdown: leave it out of the garbage collector's walks.
        freeze_gc_heap()

    # --8<-- [start:initialize_kv_caches]
    def _initialize_kv_caches(self, vllm_config: VllmConfig) -> KVCacheConfig:
        """Size the paged KV cache and allocate it in the model runner.

        From each layer's KV cache spec and the memory budget (or
        ``num_gpu_blocks_override``), ``get_kv_cache_configs`` decides how
        many blocks there are, and refuses to start, as vLLM does, when they
        cannot hold one ``max_model_len`` request.
        """
        # One answer per worker (rank).
        kv_cache_specs = self.model_executor.get_kv_cache_specs()
        available_memory = self.model_executor.determine_available_memory()
        kv_cache_configs = get_kv_cache_configs(vllm_config, kv_cache_specs, available_memory)
        scheduler_kv_cache_config = generate_scheduler_kv_cache_config(kv_cache_configs)
        num_blocks = scheduler_kv_cache_config.num_blocks
        vllm_config.cache_config.num_gpu_blocks = num_blocks
        logger.info(
            "KV cache: %d blocks of %d tokens", num_blocks, vllm_config.cache_config.block_size
        )
        if num_blocks < 2:
            # vLLM allows 1 (the null block alone), where nothing could run.
            raise ValueError(
                f"The KV cache has room for {num_blocks} blocks; at least 2 are needed "
                "(block 0 is reserved). Raise kv_cache_memory_bytes."
            )
        self.model_executor.initialize_from_config(kv_cache_configs)
        return scheduler_kv_cache_config

    # --8<-- [end:initialize_kv_caches]

    # --- requests ---------------------------------------------------------
    def preprocess_add_request(self, request: EngineCoreRequest) -> Request:
        """Turn the wire request into the core's ``Request`` (hashes computed here).

        In EngineCoreProc this runs on the input thread, off the busy loop; so
        does the start of a structured request's grammar compilation.
        """
        req = Request.from_engine_core_request(request, self.request_block_hasher)
        if req.use_structured_output:
            self.structured_output_manager.grammar_init(req)
        return req

    @tracing.instrument(
        "EngineCore.add_request",
        parent=records.core_add_request_parent,
        record=records.core_add_request,
    )
    def add_request(self, request: Request) -> None:
        """Hand a request to the scheduler's waiting queue.

        Its span's parent is the frontend's ``llm_request`` span, carried over
        the process boundary in ``trace_headers``.
        """
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def abort_all_after_failed_step(self) -> None:
        """Leave the engine consistent after a step raised (in-process only).

        tracevllm's own: in its own process, an exception in a step kills
        EngineCore (the frontend gets EngineDeadError), as in vLLM. In the
        caller's process (InprocClient) the exception, or a Ctrl-C, reaches
        the caller mid-step instead: every request is finished with an
        error, which frees its KV blocks, and the runner forgets them all,
        so the next call starts clean.
        """
        self.scheduler.finish_requests(None, RequestStatus.FINISHED_ERROR)
        # The failed step's full blocks were cached when it was scheduled, but
        # their KV may never have been written: a later hit would read it.
        self.scheduler.reset_prefix_cache()
        if self.batch_queue is not None:
            # Their answers are read, in order, before the next call's.
            self.batch_queue.clear()
        self.model_executor.drop_all_requests()

    # --- the step -----------------------------------------------------------
    # --8<-- [start:step]
    @tracing.instrument("EngineCore.step", parent=records.step_parent, record=records.step)
    def step(self) -> tuple[dict[int, EngineCoreOutputs], bool]:
        """Schedule, execute, and make output.

        Returns the outputs per client and whether the model ran.
        """
        if not self.scheduler.has_requests():
            return {}, False
        scheduler_output = self.scheduler.schedule()
        model_output = self.model_executor.execute_model(scheduler_output)
        # vLLM fills the bitmask while the forward runs; here, after it.
        grammar_output = self.scheduler.get_grammar_bitmask(scheduler_output)
        if model_output is None:
            model_output = self.model_executor.sample_tokens(grammar_output)
        # Aborts that arrived during the forward: before the output is made.
        self._process_aborts_queue()
        engine_core_outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        return engine_core_outputs, scheduler_output.total_num_scheduled_tokens > 0

    # --8<-- [end:step]

    # --8<-- [start:step_with_batch_queue]
    @tracing.instrument(
        "EngineCore.step_with_batch_queue",
        parent=records.step_parent,
        record=records.step_with_batch_queue,
    )
    def step_with_batch_queue(self) -> tuple[dict[int, EngineCoreOutputs] | None, bool]:
        """Schedule a step without waiting for the ones in flight, while the
        batch queue has room; else wait for the oldest and make its output.

        Returns None as the outputs when this call only scheduled. The
        ``Scheduler`` never schedules a request whose step is in flight again
        before its output is in: ``_update_after_schedule`` has already
        counted its tokens as computed, so a decode has nothing left to run
        (a long prompt's next chunk may go, which is how prefills pipeline).
        The ``AsyncScheduler`` does: the token in flight is a placeholder
        that the worker fills in. A structured request's bitmask needs that
        token, so such a step's sampling is deferred until the previous
        step's output is in (``pending_structured_output_tokens``).
        """
        batch_queue = self.batch_queue
        assert batch_queue is not None
        assert len(batch_queue) < self.batch_queue_size

        model_executed = False
        deferred_scheduler_output: SchedulerOutput | None = None
        info = self.batch_queue_info = dict(
            scheduled_step_id=-1, output_step_id=-1, in_flight=0, req_ids=set()
        )
        if self.scheduler.has_requests():
            scheduler_output = self.scheduler.schedule()
            info["scheduled_step_id"] = scheduler_output.step_id
            info["req_ids"].update(scheduler_output.num_scheduled_tokens)
            exec_future = self.model_executor.execute_model(scheduler_output, non_block=True)
            model_executed = scheduler_output.total_num_scheduled_tokens > 0
            future: Future[Any] | None = None
            if not model_executed:
                future = exec_future  # nothing to sample: EMPTY_MODEL_RUNNER_OUTPUT
            elif not scheduler_output.pending_structured_output_tokens:
                # Every structured request here has its earlier tokens in:
                # the bitmask can be built now.
                grammar_output = self.scheduler.get_grammar_bitmask(scheduler_output)
                future = self.model_executor.sample_tokens(grammar_output, non_block=True)
            else:
                # Sample once the step in flight is in (below).
                deferred_scheduler_output = scheduler_output
            if future is not None:
                batch_queue.appendleft(
                    (cast("Future[ModelRunnerOutput]", future), scheduler_output, exec_future)
                )
            # Steps that run the model, sent and not yet answered.
            in_flight = sum(so.total_num_scheduled_tokens > 0 for _, so, _ in batch_queue)
            info["in_flight"] = in_flight + (deferred_scheduler_output is not None)
            self.max_batches_in_flight = max(self.max_batches_in_flight, info["in_flight"])
            if (
                future is not None
                and model_executed
                and len(batch_queue) < self.batch_queue_size
                and not batch_queue[-1][0].done()
            ):
                # Room for another step: schedule it before waiting for this one.
                return None, True
        elif not batch_queue:
            return None, False

        # Wait for the oldest step in flight.
        future, scheduler_output, exec_model_fut = batch_queue.pop()
        model_output = future.result()
        # A forward that failed raises here: the runner's sample_tokens then
        # answers with an empty output (vLLM's with None, for the same check).
        exec_model_fut.result()
        if model_output is None:
            raise RuntimeError("unexpected error")
        info["output_step_id"] = scheduler_output.step_id
        info["req_ids"].update(scheduler_output.num_scheduled_tokens)
        self._process_aborts_queue()
        engine_core_outputs = self.scheduler.update_from_output(scheduler_output, model_output)

        if deferred_scheduler_output is not None:
            # The tokens the deferred step's grammars waited for are in (vLLM
            # would also take the drafts here; tracevllm has none with async).
            grammar_output = self.scheduler.get_grammar_bitmask(deferred_scheduler_output)
            future = self.model_executor.sample_tokens(grammar_output, non_block=True)
            batch_queue.appendleft(
                (
                    cast("Future[ModelRunnerOutput]", future),
                    deferred_scheduler_output,
                    exec_future,
                )
            )
        return engine_core_outputs, model_executed

    # --8<-- [end:step_with_batch_queue]

    def _process_aborts_queue(self) -> None:
        """Apply the aborts that came in while the step ran, as one batch.

        The same aborts also wait in the input queue, in order with the
        requests they name; applying one twice is harmless.
        """
        request_ids: list[str] = []
        while not self.aborts_queue.empty():
            request_ids.extend(self.aborts_queue.get_nowait())
        if request_ids:
            self.abort_requests(request_ids)

    def step_fn(self) -> tuple[dict[int, EngineCoreOutputs] | None, bool]:
        """One turn of the loop: step(), or step_with_batch_queue() when
        the executor runs several batches at once (vLLM picks one of the two
        as ``step_fn`` at start-up)."""
        if self.scheduler.only_waiting_for_grammars() and not self.batch_queue:
            if self.scheduler.only_waiting_for_remote_kvs():
                # tracevllm: only KV transfers are left: loads in
                # WAITING_FOR_REMOTE_KVS, or finished requests whose blocks a
                # remote reader still holds (up to
                # TRACEVLLM_NIXL_ABORT_REQUEST_TIMEOUT). A step only polls the
                # connector's get_finished then: poll every KV_TRANSFER_POLL_S
                # instead of spinning a core, as vLLM's loop does. Such a step
                # schedules nothing, so it makes no span either (48 000 step
                # spans over one held request's 480 s otherwise); a transfer's
                # own span, in its request's trace, still records. A load
                # that fails under kv_load_failure_policy="fail" finishes its
                # request in such a step: the request's span and the failed
                # transfer's show it, no step span does.
                self._pause_for_transfers()
                with tracing.untraced():
                    return self._step()
            # tracevllm: nothing can run before a grammar compiles, so wait
            # for one (50 ms at most: new requests are read between waits)
            # instead of spinning through empty steps, as vLLM does.
            self.structured_output_manager.wait_for_grammars(
                self.scheduler.skipped_waiting, timeout=0.05
            )
        return self._step()

    def _step(self) -> tuple[dict[int, EngineCoreOutputs] | None, bool]:
        if self.batch_queue is not None:
            return self.step_with_batch_queue()
        return self.step()

    def _pause_for_transfers(self) -> None:
        """Between two polls of pending KV transfers; EngineCoreProc's skips
        the pause when a client request is waiting to be read."""
        time.sleep(KV_TRANSFER_POLL_S)

    def has_work(self) -> bool:
        """Whether the engine should be stepped: requests, or steps in flight."""
        return self.scheduler.has_requests() or bool(self.batch_queue)

    # --8<-- [start:post_step]
    def post_step(self, model_executed: bool) -> None:
        """After the outputs went out: the drafts for the next step, if speculating
        (not with async scheduling: vLLM keeps those drafts on the worker)."""
        if not self.async_scheduling and self.use_spec_decode and model_executed:
            draft_token_ids = self.model_executor.take_draft_token_ids()
            if draft_token_ids is not None:
                self.scheduler.update_draft_token_ids(draft_token_ids)

    # --8<-- [end:post_step]

    # --- utilities (called by name from the client) -------------------------
    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """``method`` on every worker, their results in rank order (vLLM's)."""
        return list(self.model_executor.collective_rpc(method, timeout, tuple(args), kwargs))

    def get_kv_cache_stats(self) -> dict[str, int]:
        """Block counts, for tests and views: free + in use == total."""
        pool = self.scheduler.kv_cache_manager.block_pool
        total = pool.get_num_usable_blocks()
        free = pool.get_num_free_blocks()
        return {"total": total, "free": free, "used": total - free}

    def shutdown(self) -> None:
        """Each step in its own try (tracevllm's; vLLM's stops at the first
        that raises): the scheduler's and the worker's KV connectors are shut
        down even when the executor's shutdown fails. The first error is
        raised once all have run; later ones are logged."""
        steps: list[tuple[str, Callable[[], None]]] = [
            ("structured output backend", self.structured_output_manager.clear_backend),
            ("executor", self.model_executor.shutdown),
            ("scheduler", self.scheduler.shutdown),
        ]
        if self.vllm_config.kv_transfer_config is not None:
            # The worker's Worker.shutdown does this too (vLLM's place, and
            # the only one in a worker process); again here in case the
            # executor's shutdown failed before it (a no-op otherwise).
            steps.append(("KV connector", lambda: ensure_kv_transfer_shutdown(self.vllm_config)))
        # Undo freeze_gc_heap, so that an engine dropped in-process can be
        # collected. Process-wide, as vLLM's: it unfreezes any other
        # in-process engine's heap too (which then costs walks, not memory).
        steps.append(("gc", gc.unfreeze))
        first_error: BaseException | None = None
        for what, step in steps:
            try:
                step()
            except BaseException as e:  # a signal's SystemExit too: the rest still run
                if first_error is None:
                    first_error = e
                else:
                    logger.exception("EngineCore shutdown: the %s's shutdown failed too", what)
        if first_error is not None:
            raise first_error


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
        try:
            self._start(vllm_config, input_address, output_address, log_stats)
        except BaseException:
            # A start-up that fails, or is cut short (SystemExit: the frontend
            # died, or asked this process to stop), stops the workers it
            # started and releases their queues before the process goes.
            if hasattr(self, "scheduler"):
                self.shutdown()
            elif hasattr(self, "model_executor"):
                self.model_executor.shutdown()
            raise

    def _start(
        self, vllm_config: VllmConfig, input_address: str, output_address: str, log_stats: bool
    ) -> None:
        super().__init__(vllm_config, log_stats=log_stats)

        # A worker that dies (MultiprocExecutor) wakes the busy loop, idle or not.
        def executor_fail_callback() -> None:
            reason = getattr(self.model_executor, "failure_reason", None) or "Executor failed."
            self.input_queue.put_nowait((EngineCoreRequestType.EXECUTOR_FAILED, reason))

        self.model_executor.register_failure_callback(executor_fail_callback)

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
    def run_engine_core(
        *args: Any,
        startup_error_pipe: Connection | None = None,
        dp_rank: int | None = None,
        **kwargs: Any,
    ) -> None:
        """Entry point of the engine process (the target of multiprocessing).

        Its own TracerProvider is made here, in the child, and flushed in
        ``finally`` (multiprocessing exits children with os._exit, which skips
        atexit hooks). A failure before READY is sent back, in words, on
        ``startup_error_pipe`` (tracevllm's; vLLM reports it through its
        handshake socket). On the way out, for whatever reason, it removes
        the frontend's socket directory too, so that a frontend killed by a
        signal leaves no socket file behind.
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
        resource_attributes = None
        if dp_rank is not None:
            # One of D data-parallel engines: its copy of the config says which.
            vllm_config.parallel_config.data_parallel_rank = dp_rank
            resource_attributes = {SpanAttributes.DP_RANK: dp_rank}
        tracing.init_tracer(
            "engine_core",
            vllm_config.trace_config,
            vllm_config.observability_config,
            resource_attributes=resource_attributes,
        )
        end_startup_watch = _watch_parent_during_startup(kwargs["input_address"])
        try:
            # The labs plugged into this process's engine, in its own words.
            labs.announce(f"engine core process, pid {os.getpid()}")
            proc_class = EngineCoreProc if dp_rank is None else DPEngineCoreProc
            engine_core = proc_class(*args, **kwargs)
            # Started: from here the input thread watches the parent.
            end_startup_watch()
            engine_core.run_busy_loop()
        except SystemExit:
            logger.debug("EngineCore exiting.")
        except Exception as e:
            if engine_core is None and startup_error_pipe is not None:
                logger.exception("EngineCore failed to start.")
                with contextlib.suppress(OSError):
                    startup_error_pipe.send(f"{type(e).__name__}: {e}")
            else:
                logger.exception("EngineCore encountered a fatal error.")
                if engine_core is not None:
                    engine_core._send_engine_dead(f"{type(e).__name__}: {e}")
            raise
        finally:
            # From here a SIGTERM (the frontend's, after a fatal error) must
            # not cut the way out short.
            shutdown_requested = True
            # The steps' spans first: stopping the workers may outlast the
            # frontend's patience (ENGINE_CORE_EXIT_TIMEOUT_S), and SIGKILL
            # would take the unwritten ones along.
            tracing.flush_tracer()
            if engine_core is not None:
                engine_core.shutdown()
            tracing.shutdown_tracer()
            _remove_socket_dir(kwargs["input_address"])

    def _pause_for_transfers(self) -> None:
        if self.input_queue.empty():  # a new request goes in without delay
            time.sleep(KV_TRANSFER_POLL_S)

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
        while not self.has_work():
            if self.input_queue.empty():
                # Idle: every abort queued so far is in the input queue too.
                with self.aborts_queue.mutex:
                    self.aborts_queue.queue.clear()
            try:
                # A timeout, not a plain get(): SIGTERM's Python handler runs
                # in this (the main) thread between two bytecodes, and the
                # signal may land on another thread, which wakes nothing here.
                req = self.input_queue.get(timeout=IDLE_WAKEUP_S)
            except queue.Empty:
                continue
            if not self._handle_client_request(*req):
                return False
        while not self.input_queue.empty():
            if not self._handle_client_request(*self.input_queue.get_nowait()):
                return False
        return True

    def _process_engine_step(self) -> bool:
        outputs, model_executed = self.step_fn()
        for output in (outputs or {}).items():
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
                # Encoded here as well as in the output thread: a result that
                # cannot cross (a tensor, a model from collective_rpc) fails this
                # call instead of that thread, which would take the engine down.
                MsgpackEncoder().encode(output)
            except Exception as e:
                logger.exception("Utility call %s failed", method_name)
                output.result = None
                output.failure_message = f"Call to {method_name} method failed: {e}"
            self.output_queue.put_nowait((client_index, EngineCoreOutputs(utility_output=output)))
        elif request_type == EngineCoreRequestType.EXECUTOR_FAILED:
            if isinstance(request, str):  # the executor failed: a worker died
                raise RuntimeError(f"Executor failed: {request}")
            if isinstance(request, BaseException):
                # An I/O thread failed: without it the frontend would wait forever.
                raise RuntimeError("An EngineCore I/O thread failed.") from request
            return False  # the input thread saw the frontend vanish
        return True

    # --8<-- [start:process_input_sockets]
    def process_input_sockets(self, input_address: str) -> None:
        """Input thread: decode frames into ``input_queue``.

        Also watches the parent process: if the frontend dies without a word
        (SIGKILL), the engine must not live on as an orphan. A request that
        cannot be decoded or prepared is answered with an error output
        (vLLM's ``_handle_request_preproc_error``); if the thread itself
        fails, the busy loop is told, and the engine reports itself dead.
        """
        try:
            self._process_input_sockets(input_address)
        except BaseException as e:
            logger.exception("EngineCore input thread failed.")
            self.input_queue.put_nowait((EngineCoreRequestType.EXECUTOR_FAILED, e))
        finally:
            self._ready.set()

    def _process_input_sockets(self, input_address: str) -> None:
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
                kv_cache_block_limits=self.kv_cache_block_limits,
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
                    try:
                        request = self.preprocess_add_request(add_decoder.decode(data_frames))
                    except Exception:
                        self._handle_request_preproc_error(generic_decoder, data_frames)
                        continue
                else:
                    request = generic_decoder.decode(data_frames)
                    if request_type == EngineCoreRequestType.ABORT:
                        # Both queues, as vLLM: the busy loop applies it before
                        # the running step's output (eager), and in order with
                        # the requests before it (the input queue).
                        self.aborts_queue.put_nowait(request)
                self.input_queue.put_nowait((request_type, request))

    # --8<-- [end:process_input_sockets]

    def _handle_request_preproc_error(self, decoder: MsgpackDecoder, frames: Any) -> None:
        """Answer a request that failed to decode or prepare with an ERROR output.

        vLLM does this for a failed ``preprocess_add_request``; tracevllm also
        for a frame that does not decode (a field of the wrong type), as long
        as its request id can still be read. If not, the input thread fails,
        and with it the engine: never a request nobody answers.
        """
        logger.exception("Unexpected error pre-processing a request")
        values = decoder.decode(frames)  # EngineCoreRequest is a msgpack array
        names = EngineCoreRequest.__struct_fields__
        fields = dict(zip(names, values))  # trailing defaults are not sent
        request_id, client_index = fields.get("request_id"), fields.get("client_index", 0)
        if not isinstance(request_id, str) or not isinstance(client_index, int):
            raise ValueError("An ADD frame without a readable request id.")
        output = EngineCoreOutput(request_id, [], finish_reason=FinishReason.ERROR)
        self.output_queue.put_nowait((client_index, EngineCoreOutputs(outputs=[output])))

    def process_output_sockets(self, output_address: str) -> None:
        """Output thread: encode and PUSH whatever the busy loop produced."""
        try:
            encoder = MsgpackEncoder()
            with self.ctx.socket(zmq.PUSH) as socket:
                socket.setsockopt(zmq.LINGER, 4000)
                socket.connect(output_address)
                while True:
                    output = self.output_queue.get()
                    if isinstance(output, bytes):  # ENGINE_CORE_DEAD
                        socket.send(output)
                        return
                    assert isinstance(output, tuple)
                    client_index, outputs = output
                    outputs.engine_index = self.engine_index
                    socket.send(encoder.encode(outputs))
        except BaseException as e:
            logger.exception("EngineCore output thread failed.")
            self.input_queue.put_nowait((EngineCoreRequestType.EXECUTOR_FAILED, e))

    def _send_engine_dead(self, reason: str = "") -> None:
        # The reason rides after vLLM's marker (tracevllm's), for the frontend's error.
        self.output_queue.put_nowait(ENGINE_CORE_DEAD + reason.encode())
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


class DPEngineCoreProc(EngineCoreProc):
    """One data-parallel engine core: EngineCoreProc plus the coordinator's side.

    Mirrors vLLM's ``DPEngineCoreProc``: the engine's index is its DP rank;
    it publishes its queue lengths (waiting, running) to the ``DPCoordinator``
    whenever they change, before and after each step, for the frontend's
    least-loaded choice; and it keeps the request wave (``current_wave``):
    a request of a newer wave moves it on, ``START_DP_WAVE`` from the
    coordinator wakes it into the wave, and when it runs out of work it says
    ``wave_complete`` and moves to the next wave. Departure (see
    coordinator.py): vLLM uses this class for MoE models only, whose DP
    engines must step in lockstep (an idle one runs dummy batches, and an
    all-reduce over the DP group every 32 steps decides when all are idle).
    tracevllm's models are dense: no collective joins the engines, so
    ``_has_global_unfinished_reqs`` is this engine's own answer, and an idle
    engine woken by START_DP_WAVE takes one empty turn and reports the wave
    finished, holding up no one.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        input_address: str,
        output_address: str,
        engine_index: int = 0,
        log_stats: bool = True,
        *,
        coordinator_input: str,
        coordinator_output: str,
    ) -> None:
        parallel_config = vllm_config.parallel_config
        self.dp_rank = parallel_config.data_parallel_rank
        self.dp_size = parallel_config.data_parallel_size
        assert self.dp_size > 1 and 0 <= self.dp_rank < self.dp_size
        # Counts the turns of this wave; the wave; the counts last published.
        self.step_counter = 0
        self.current_wave = 0
        self.last_counts = (0, 0)
        self.engines_running = False
        self.coordinator_output = coordinator_output
        # tracevllm's, for get_dp_state: requests taken, steps that ran the
        # model, and turns that did not (a wave joined with nothing to do).
        self.num_requests_added = 0
        self.num_model_steps = 0
        self.num_empty_steps = 0
        # request id -> the wave its frontend saw (written by the input thread).
        self._request_waves: dict[str, int] = {}
        # Subscribe to the coordinator before loading the model: it answers
        # READY once every engine has, so no START_DP_WAVE is missed.
        self.coord_ctx = zmq.Context()
        self.coord_input_socket = self.coord_ctx.socket(zmq.XSUB)
        self.coord_input_socket.setsockopt(zmq.LINGER, 0)
        self.coord_input_socket.connect(coordinator_input)
        self.coord_input_socket.send(b"\x01")
        self._wait_for_coordinator()
        super().__init__(
            vllm_config,
            input_address,
            output_address,
            engine_index=self.dp_rank,
            log_stats=log_stats,
        )
        self.coord_thread = threading.Thread(
            target=self.process_coordinator_socket, name="DPCoordinatorInputThread", daemon=True
        )
        self.coord_thread.start()

    def _wait_for_coordinator(self) -> None:
        parent = multiprocessing.parent_process()
        poller = zmq.Poller()
        poller.register(self.coord_input_socket, zmq.POLLIN)
        if parent is not None:
            poller.register(parent.sentinel, zmq.POLLIN)
        while True:
            events = dict(poller.poll())
            if parent is not None and parent.sentinel in events:
                raise SystemExit()
            if self.coord_input_socket in events and self.coord_input_socket.recv() == b"READY":
                return

    def process_coordinator_socket(self) -> None:
        """Coordinator thread: START_DP_WAVE messages into the input queue."""
        decoder = MsgpackDecoder()
        try:
            while True:
                frames = self.coord_input_socket.recv_multipart()
                if frames[0] != EngineCoreRequestType.START_DP_WAVE.value:
                    continue  # a READY re-sent for another engine
                wave, exclude_eng_index = decoder.decode(frames[1])
                self.input_queue.put_nowait(
                    (EngineCoreRequestType.START_DP_WAVE, (wave, exclude_eng_index))
                )
        except BaseException as e:
            logger.exception("DPEngineCoreProc coordinator thread failed.")
            self.input_queue.put_nowait((EngineCoreRequestType.EXECUTOR_FAILED, e))

    def preprocess_add_request(self, request: EngineCoreRequest) -> Request:
        req = super().preprocess_add_request(request)
        self._request_waves[req.request_id] = request.current_wave
        return req

    def add_request(self, request: Request, request_wave: int = 0) -> None:
        super().add_request(request)
        self.num_requests_added += 1
        if request_wave != self.current_wave:
            if request_wave > self.current_wave:
                self.current_wave = request_wave
            elif not self.engines_running:
                # A request of a wave that has ended: the others must start
                # the next one too (the frontend did not know it had ended).
                self.engines_running = True
                self.output_queue.put_nowait((-1, EngineCoreOutputs(start_wave=self.current_wave)))

    def _handle_client_request(self, request_type: EngineCoreRequestType, request: Any) -> bool:
        if request_type == EngineCoreRequestType.ADD:
            wave = self._request_waves.pop(request.request_id, self.current_wave)
            self.add_request(request, wave)
            return True
        if request_type == EngineCoreRequestType.START_DP_WAVE:
            new_wave, exclude_eng_index = request
            if exclude_eng_index != self.engine_index and new_wave >= self.current_wave:
                self.current_wave = new_wave
                if not self.engines_running:
                    logger.debug("EngineCore starting idle loop for wave %d.", new_wave)
                    self.engines_running = True
            return True
        return super()._handle_client_request(request_type, request)

    def has_work(self) -> bool:
        # In a wave, the loop turns even with nothing scheduled: to say it is done.
        return super().has_work() or self.engines_running

    def _maybe_publish_request_counts(self) -> None:
        """Send (running, waiting) to the coordinator if they changed."""
        scheduler = self.scheduler
        counts = (len(scheduler.running), len(scheduler.waiting) + len(scheduler.skipped_waiting))
        if counts != self.last_counts:
            self.last_counts = counts
            stats = SchedulerStats(
                num_running_reqs=counts[0],
                num_waiting_reqs=counts[1],
                step_counter=self.step_counter,
                current_wave=self.current_wave,
            )
            self.output_queue.put_nowait((-1, EngineCoreOutputs(scheduler_stats=stats)))

    # --8<-- [start:dp_busy_loop]
    def run_busy_loop(self) -> None:
        """Core busy loop of a data-parallel engine: steps, counts and waves."""
        while True:
            # 1) Wait for work (a request, or a wave to join), take it in.
            if not self._process_input_queue():
                return
            self._maybe_publish_request_counts()
            # 2) Step; publish the counts again so the frontend sees them fresh.
            executed = self._process_engine_step()
            self._maybe_publish_request_counts()
            if executed:
                self.num_model_steps += 1
            else:
                self.num_empty_steps += 1
            local_unfinished_reqs = EngineCore.has_work(self)
            if not executed and not local_unfinished_reqs and not self.engines_running:
                continue
            # 3) Whether the wave goes on (vLLM: an all-reduce over the DP group).
            self.engines_running = self._has_global_unfinished_reqs(local_unfinished_reqs)
            if not self.engines_running:
                # This engine is done with the wave: the coordinator ends it
                # once every engine is.
                logger.debug("Wave %d finished, pausing engine loop.", self.current_wave)
                self.output_queue.put_nowait(
                    (-1, EngineCoreOutputs(wave_complete=self.current_wave))
                )
                self.current_wave += 1
                self.step_counter = 0

    def _has_global_unfinished_reqs(self, local_unfinished: bool) -> bool:
        # Dense models: nothing to agree on with the other engines.
        self.step_counter += 1
        return local_unfinished

    # --8<-- [end:dp_busy_loop]

    def get_dp_state(self) -> dict[str, Any]:
        """This engine's DP view (a utility, for tests and views)."""
        return {
            "dp_rank": self.dp_rank,
            "pid": os.getpid(),
            "current_wave": self.current_wave,
            "engines_running": self.engines_running,
            "num_requests_added": self.num_requests_added,
            "num_model_steps": self.num_model_steps,
            "num_empty_steps": self.num_empty_steps,
        }

    def process_output_sockets(self, output_address: str) -> None:
        """Output thread: outputs to the frontend, and (client index -1) the
        counts and wave notices to the coordinator, as vLLM's."""
        try:
            encoder = MsgpackEncoder()
            with (
                self.ctx.socket(zmq.PUSH) as socket,
                self.ctx.socket(zmq.PUSH) as coord_socket,
            ):
                socket.setsockopt(zmq.LINGER, 4000)
                socket.connect(output_address)
                coord_socket.setsockopt(zmq.LINGER, 0)
                coord_socket.connect(self.coordinator_output)
                while True:
                    output = self.output_queue.get()
                    if isinstance(output, bytes):  # ENGINE_CORE_DEAD
                        socket.send(output)
                        return
                    client_index, outputs = output
                    outputs.engine_index = self.engine_index
                    target = coord_socket if client_index == -1 else socket
                    target.send(encoder.encode(outputs))
        except BaseException as e:
            logger.exception("EngineCore output thread failed.")
            self.input_queue.put_nowait((EngineCoreRequestType.EXECUTOR_FAILED, e))
