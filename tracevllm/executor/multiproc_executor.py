"""One process per rank, driven through shared memory.

Mirrors vllm/v1/executor/multiproc_executor.py (``MultiprocExecutor``,
``WorkerProc``, ``FutureWrapper``). EngineCore's process starts T x P worker
processes (spawned), each running a ``Worker``. Every call goes to all of
them at once through one ``MessageQueue`` (``collective_rpc``); each worker
answers on its own queue, and for the step's calls only the output rank
(TP rank 0 of the last pipeline stage) answers at all. A monitor thread
watches the workers' process sentinels: one that dies fails the executor at
once (its rank and exit in the error), and the rest are stopped. Each worker
watches a "death pipe" from this process: when it closes (the executor
stopped, or its process died however), the worker exits.

``WorkerProc``, the worker process's side, is in executor/worker_proc.py.

Departures: the ranks meet through a ``file://`` rendezvous (vLLM: an open
TCP port), gone once every worker is ready; a function sent to the workers
is pickled by reference (vLLM: cloudpickle); no multi-node ``mp``; the
step's trace context travels with each call. With async scheduling the
engine core sends step N+1 before step N's answer is read
(``execute_model(..., non_block=True)`` returns a ``FutureWrapper``): the
workers run the calls in the order they were sent. Left out: KV connector
output aggregation, NUMA binding.
"""

from __future__ import annotations

import multiprocessing
import pickle
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from contextlib import suppress
from multiprocessing.process import BaseProcess
from typing import Any, cast

from tracevllm import envs, tracing
from tracevllm.core.sched.output import GrammarOutput, SchedulerOutput
from tracevllm.distributed.device_communicators.shm_broadcast import MessageQueue
from tracevllm.distributed.utils import temporary_file_init_method
from tracevllm.engine.exceptions import describe_exit
from tracevllm.executor.abstract import Executor, FailureCallback
from tracevllm.executor.worker_proc import WorkerProc, WorkerProcHandle
from tracevllm.logger import init_logger

__all__ = ["FutureWrapper", "MultiprocExecutor", "WorkerProc"]
from tracevllm.outputs import DraftTokenIds, ModelRunnerOutput

logger = init_logger(__name__)

# How long the workers may take to connect their queues once they are ready.
_QUEUE_READY_TIMEOUT_S = 60.0


class FutureWrapper(Future):  # type: ignore[type-arg]
    """A call's result, read when asked for, after the calls sent before it."""

    def __init__(
        self,
        futures_queue: deque[FutureWrapper],
        get_response: Callable[[], Any],
        aggregate: Callable[[Any], Any] = lambda x: x,
    ) -> None:
        self.futures_queue = futures_queue
        self.get_response = get_response
        self.aggregate = aggregate
        super().__init__()
        self.futures_queue.appendleft(self)

    def result(self, timeout: float | None = None) -> Any:
        if timeout is not None:
            raise RuntimeError("timeout not implemented")
        # The answers come back in the order the calls went out.
        while not self.done():
            self.futures_queue.pop()._wait_for_response()
        return super().result()

    def _wait_for_response(self) -> None:
        try:
            response = self.aggregate(self.get_response())
            with suppress(InvalidStateError):
                self.set_result(response)
        except Exception as e:
            with suppress(InvalidStateError):
                self.set_exception(e)


def _death_reason(dead: WorkerProcHandle) -> str:
    dead.proc.join(timeout=1)  # reaped, so its exit code is known
    return (
        f"Worker process {dead.proc.name} (rank {dead.rank}, pid {dead.proc.pid}) "
        f"{describe_exit(dead.proc.exitcode)}."
    )


class MultiprocExecutor(Executor):
    supports_pp = True

    def __init__(self, vllm_config: Any, monitor_workers: bool = True) -> None:
        self.monitor_workers = monitor_workers
        super().__init__(vllm_config)

    # --8<-- [start:init_executor]
    def _init_executor(self) -> None:
        # Stop the workers at exit, even if nobody calls shutdown().
        self._finalizer = weakref.finalize(self, self.shutdown)
        self.is_failed = False
        self.failure_reason: str | None = None
        self.failure_callback: FailureCallback | None = None
        self.shutting_down = False
        self._shutdown_lock = threading.Lock()
        self._monitor_thread: threading.Thread | None = None
        self.workers: list[WorkerProcHandle] = []
        self.response_mqs: list[MessageQueue] = []
        # Per rank: replies still owed to calls that timed out (tracevllm's;
        # vLLM's next call would read such a reply as its own).
        self._stale_replies: Counter[int] = Counter()
        self.world_size = self.parallel_config.world_size
        tp_size = self.parallel_config.tensor_parallel_size
        # EngineCore's process is a daemon (so that the frontend's exit ends
        # it), and daemons may not start processes; these workers are
        # stopped by shutdown() and by their death pipes. (vLLM's EngineCore
        # is no daemon.)
        multiprocessing.current_process().daemon = False

        # One ring buffer, every rank reads it.
        self.rpc_broadcast_mq = MessageQueue(self.world_size, self.world_size)
        scheduler_output_handle = self.rpc_broadcast_mq.export_handle()
        unready = []
        success = False
        try:
            # The rendezvous lives until every rank has made its groups (READY).
            with temporary_file_init_method() as distributed_init_method:
                for rank in range(self.world_size):
                    unready.append(
                        WorkerProc.make_worker_process(
                            vllm_config=self.vllm_config,
                            local_rank=rank,
                            rank=rank,
                            distributed_init_method=distributed_init_method,
                            input_shm_handle=scheduler_output_handle,
                            is_driver_worker=rank % tp_size == 0,
                        )
                    )
                self.workers = WorkerProc.wait_for_ready(unready)
            if self.monitor_workers:
                self.start_worker_monitor()
            self.response_mqs = [w.worker_response_mq for w in self.workers]
            # Collective with the workers' own calls (see WorkerProc.worker_main).
            self.rpc_broadcast_mq.wait_until_ready(timeout=_QUEUE_READY_TIMEOUT_S)
            for response_mq in self.response_mqs:
                response_mq.wait_until_ready(timeout=_QUEUE_READY_TIMEOUT_S)
            self.futures_queue: deque[FutureWrapper] = deque()
            success = True
        finally:
            if not success:
                for uw in unready:
                    uw.death_writer.close()
                self._ensure_worker_termination([uw.proc for uw in unready])
                self.rpc_broadcast_mq.close()
                for mq in self.response_mqs:
                    mq.close()
        self.output_rank = self._get_output_rank()

    # --8<-- [end:init_executor]

    def _get_output_rank(self) -> int:
        """TP rank 0 of the last pipeline stage: ranks go TP fastest, so with
        T = 2, P = 2 the stages are ranks [0, 1] and [2, 3], and it is 2."""
        return self.world_size - self.parallel_config.tensor_parallel_size

    # --8<-- [start:worker_monitor]
    def start_worker_monitor(self) -> None:
        """A thread that wakes when any worker process ends, and fails the executor."""
        workers = self.workers
        self_ref = weakref.ref(self)

        def monitor_workers() -> None:
            sentinels = [h.proc.sentinel for h in workers]
            died = multiprocessing.connection.wait(sentinels)
            _self = self_ref()
            if _self is None or _self.shutting_down:
                return
            dead = next(h for h in workers if h.proc.sentinel == died[0])
            _self.failure_reason = _self.failure_reason or _death_reason(dead)
            _self.is_failed = True
            logger.error("%s Shutting down the executor.", _self.failure_reason)
            # Wake a call that waits on the queues, tell EngineCore, then stop
            # the other ranks (vLLM stops them first; they may take seconds).
            _self._cancel_queues()
            callback, _self.failure_callback = _self.failure_callback, None
            if callback is not None:
                callback()
            _self.shutdown()

        self._monitor_thread = threading.Thread(
            target=monitor_workers, daemon=True, name="MultiprocWorkerMonitor"
        )
        self._monitor_thread.start()

    # --8<-- [end:worker_monitor]

    def register_failure_callback(self, callback: FailureCallback) -> None:
        if self.is_failed:
            callback()
        else:
            self.failure_callback = callback

    def _dead_worker_reason(self, grace_s: float = 1.0) -> str | None:
        """Which worker died, if one did (waiting up to ``grace_s`` for its
        process to be seen gone: a peer can hear of it a moment sooner); it
        becomes the executor's failure reason."""
        sentinels = {h.proc.sentinel: h for h in self.workers}
        died = multiprocessing.connection.wait(list(sentinels), timeout=grace_s)
        if died:
            dead = sentinels[cast(int, died[0])]
            self.failure_reason = self.failure_reason or _death_reason(dead)
            self.is_failed = True
        return self.failure_reason if died else None

    def _failure_error(self) -> RuntimeError:
        return RuntimeError(f"Executor failed: {self.failure_reason or 'it was shut down'}")

    # --8<-- [start:collective_rpc]
    def collective_rpc(  # type: ignore[override]
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> Any:
        """Every worker runs ``method``; one result if ``unique_reply_rank``
        (only that rank answers), else the list of all, in rank order."""
        if self.is_failed or self.shutting_down:
            raise self._failure_error()
        deadline = None if timeout is None else time.monotonic() + timeout
        # The current span's context goes along: the workers' spans join its trace.
        trace_headers = tracing.inject_trace_context() if tracing.is_enabled() else None
        # A function travels pickled on its own, so a worker that cannot load it
        # answers with the error instead of dying on the message (vLLM's too).
        send_method = method if isinstance(method, str) else pickle.dumps(method)
        message = (send_method, args, kwargs or {}, unique_reply_rank, trace_headers)
        try:
            self.rpc_broadcast_mq.enqueue(message, timeout=timeout)
        except RuntimeError as e:  # cancelled: a worker died meanwhile
            raise self._failure_error() from e
        ranks = list(range(len(self.response_mqs)))
        if unique_reply_rank is not None:
            ranks = [unique_reply_rank]

        def get_response() -> Any:
            responses = []
            for i, rank in enumerate(ranks):
                mq = self.response_mqs[rank]
                try:
                    # Replies to calls that timed out come first: dropped.
                    while True:
                        left = None if deadline is None else deadline - time.monotonic()
                        status, result = mq.dequeue(timeout=left)
                        if not self._stale_replies[rank]:
                            break
                        self._stale_replies[rank] -= 1
                except TimeoutError as e:
                    # This rank and those not read yet will still answer this
                    # call; the next call must not take that answer for its own.
                    for late in ranks[i:]:
                        self._stale_replies[late] += 1
                    raise TimeoutError(f"RPC call to {method} timed out.") from e
                except RuntimeError as e:
                    raise self._failure_error() from e
                if status != WorkerProc.ResponseStatus.SUCCESS:
                    # A rank that dies fails its peers' collectives ("Connection
                    # reset by peer"), and their answer can come in before the
                    # monitor has seen the death: the death is the cause.
                    if self._dead_worker_reason() is not None:
                        raise self._failure_error()
                    raise RuntimeError(
                        f"Worker failed with error '{result}', please check the "
                        "stack trace above for the root cause"
                    )
                responses.append(result)
            return responses[0] if unique_reply_rank is not None else responses

        future = FutureWrapper(self.futures_queue, get_response)
        return future if non_block else future.result()

    # --8<-- [end:collective_rpc]

    def execute_model(  # type: ignore[override]
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | None | Future[ModelRunnerOutput | None]:
        return self.collective_rpc(
            "execute_model",
            args=(scheduler_output,),
            unique_reply_rank=self.output_rank,
            non_block=non_block,
            timeout=envs.TRACEVLLM_EXECUTE_MODEL_TIMEOUT_SECONDS,
        )

    def sample_tokens(  # type: ignore[override]
        self, grammar_output: GrammarOutput | None, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        return self.collective_rpc(
            "sample_tokens",
            args=(grammar_output,),
            unique_reply_rank=self.output_rank,
            non_block=non_block,
            timeout=envs.TRACEVLLM_EXECUTE_MODEL_TIMEOUT_SECONDS,
        )

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        return self.collective_rpc("take_draft_token_ids", unique_reply_rank=self.output_rank)

    def drop_all_requests(self) -> None:
        if not (self.is_failed or self.shutting_down):
            self.collective_rpc("drop_all_requests")

    def check_health(self) -> None:
        self.collective_rpc("check_health", timeout=10)

    @property
    def max_concurrent_batches(self) -> int:
        # PP needs P batches in flight to fill the pipeline; async scheduling
        # two: the one the workers run and the one scheduled meanwhile.
        pp_size = self.parallel_config.pipeline_parallel_size
        return 2 if pp_size <= 1 and self.scheduler_config.async_scheduling else pp_size

    # --- the end ----------------------------------------------------------------
    def _cancel_queues(self) -> None:
        """Wake whoever waits on a queue (thread-safe)."""
        self.rpc_broadcast_mq.shutdown()
        for mq in self.response_mqs:
            mq.shutdown()

    @staticmethod
    def _ensure_worker_termination(worker_procs: list[BaseProcess]) -> None:
        """Give the workers 4 s to exit on their own, then SIGTERM, then SIGKILL (vLLM's)."""

        def wait_for_termination(procs: list[BaseProcess], timeout: float) -> bool:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if not any(p.is_alive() for p in procs):
                    return True
                time.sleep(0.05)
            return False

        def active() -> list[BaseProcess]:
            return [p for p in worker_procs if p.is_alive()]

        if wait_for_termination(active(), 4):
            return
        for p in active():
            p.terminate()
        if not wait_for_termination(active(), 4):
            for p in active():
                p.kill()
        for p in worker_procs:
            p.join(timeout=1)

    def shutdown(self) -> None:
        """Stop the workers, then release the queues (idempotent).

        The monitor thread stops the workers when one dies; the queues' sockets
        are released by the next call from another thread (EngineCore's).
        """
        with self._shutdown_lock:
            first, self.shutting_down = not self.shutting_down, True
        if first:
            self._cancel_queues()
            for w in self.workers:
                # The death pipe closes: each worker leaves its busy loop.
                w.death_writer.close()
            self._ensure_worker_termination([w.proc for w in self.workers])
        monitor = self._monitor_thread
        if monitor is threading.current_thread():
            return
        if monitor is not None:
            monitor.join(timeout=15)  # it may still be stopping the workers
        for mq in [self.rpc_broadcast_mq, *self.response_mqs]:
            mq.close()
        self.response_mqs = []

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return True
