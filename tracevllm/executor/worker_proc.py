"""A worker process of ``MultiprocExecutor``: one rank, one ``Worker``.

Mirrors ``WorkerProc`` of vllm/v1/executor/multiproc_executor.py (kept in
its own file here: the executor's side and the worker's side are two
ideas). The process builds its worker (device, process groups, model),
answers READY with the handle of its response queue, then runs
``worker_busy_loop``: read a call from the broadcast queue, run it on the
worker inside the caller's trace context, answer if it is the rank asked.
It leaves when its death pipe closes (the executor stopped, or EngineCore's
process died however), on SIGTERM or SIGINT; a rank that cannot leave on
its own within a few seconds of its parent's death (stuck in a collective
with a dead peer) exits hard rather than live on as an orphan.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from enum import Enum, auto
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from tracevllm import tracing
from tracevllm.config import VllmConfig
from tracevllm.distributed.device_communicators.shm_broadcast import Handle, MessageQueue
from tracevllm.engine.exceptions import describe_exit
from tracevllm.logger import init_logger
from tracevllm.outputs import AsyncModelRunnerOutput
from tracevllm.serial_utils import run_method
from tracevllm.tracing.ranks import worker_resource_attributes
from tracevllm.worker.worker_base import WorkerWrapperBase

logger = init_logger(__name__)

# How long a worker whose parent is gone may take to leave before it exits hard.
ORPHAN_GRACE_S = 5.0
# How long a started worker may take to connect its queues.
_QUEUE_READY_TIMEOUT_S = 60.0


@dataclass
class UnreadyWorkerProcHandle:
    """A worker process before its READY."""

    proc: BaseProcess
    rank: int
    ready_pipe: Connection
    death_writer: Connection


@dataclass
class WorkerProcHandle:
    proc: BaseProcess
    rank: int
    # The worker writes its answers here; the executor reads them.
    worker_response_mq: MessageQueue
    death_writer: Connection


class WorkerProc:
    """Runs one Worker in its own process."""

    READY_STR = "READY"

    class ResponseStatus(Enum):
        SUCCESS = auto()
        FAILURE = auto()

    def __init__(
        self,
        vllm_config: VllmConfig,
        local_rank: int,
        rank: int,
        distributed_init_method: str,
        input_shm_handle: Handle,
        is_driver_worker: bool,
    ) -> None:
        self.rank = rank
        self.rpc_broadcast_mq: MessageQueue | None = None
        self.worker_response_mq: MessageQueue | None = None
        wrapper = WorkerWrapperBase(rpc_rank=local_rank, global_rank=rank)
        all_kwargs: list[dict[str, Any]] = [
            {} for _ in range(vllm_config.parallel_config.world_size)
        ]
        all_kwargs[local_rank] = dict(
            vllm_config=vllm_config,
            local_rank=local_rank,
            rank=rank,
            distributed_init_method=distributed_init_method,
            is_driver_worker=is_driver_worker,
        )
        wrapper.init_worker(all_kwargs)
        self.worker = wrapper
        self.worker.init_device()
        self.worker.load_model()
        self.rpc_broadcast_mq = MessageQueue.create_from_handle(input_shm_handle, rank)
        self.worker_response_mq = MessageQueue(1, 1)

    @staticmethod
    def make_worker_process(
        vllm_config: VllmConfig,
        local_rank: int,
        rank: int,
        distributed_init_method: str,
        input_shm_handle: Handle,
        is_driver_worker: bool,
    ) -> UnreadyWorkerProcHandle:
        """Start the process (spawned: EngineCore's process runs torch's
        thread pools, which a forked child could not use)."""
        context = multiprocessing.get_context("spawn")
        ready_reader, ready_writer = context.Pipe(duplex=False)
        # The child reads; the parent keeps the writer open while the worker
        # is wanted. Its close (or the parent's death) is the child's EOF.
        death_reader, death_writer = context.Pipe(duplex=False)
        proc = context.Process(
            target=WorkerProc.worker_main,
            kwargs=dict(
                vllm_config=vllm_config,
                local_rank=local_rank,
                rank=rank,
                distributed_init_method=distributed_init_method,
                input_shm_handle=input_shm_handle,
                is_driver_worker=is_driver_worker,
                ready_pipe=ready_writer,
                death_pipe=death_reader,
            ),
            name=f"VllmWorker-{rank}",
            daemon=True,
        )
        proc.start()
        ready_writer.close()
        death_reader.close()
        return UnreadyWorkerProcHandle(proc, rank, ready_reader, death_writer)

    @staticmethod
    def wait_for_ready(unready: list[UnreadyWorkerProcHandle]) -> list[WorkerProcHandle]:
        """Every worker's READY, in rank order; the first failure raises, in words."""
        pipes = {handle.ready_pipe: handle for handle in unready}
        ready: list[WorkerProcHandle | None] = [None] * len(unready)
        while pipes:
            for pipe in multiprocessing.connection.wait(list(pipes)):
                assert isinstance(pipe, Connection)
                handle = pipes.pop(pipe)
                try:
                    response: dict[str, Any] = pipe.recv()
                except EOFError:
                    handle.proc.join(timeout=1)
                    response = {"error": f"it {describe_exit(handle.proc.exitcode)}"}
                finally:
                    pipe.close()
                if response.get("status") != WorkerProc.READY_STR:
                    raise RuntimeError(
                        "WorkerProc initialization failed due to an exception in a "
                        f"background process (rank {handle.rank}): {response['error']}"
                    )
                response_mq = MessageQueue.create_from_handle(response["handle"], 0)
                ready[handle.rank] = WorkerProcHandle(
                    handle.proc, handle.rank, response_mq, handle.death_writer
                )
        return [h for h in ready if h is not None]

    # --8<-- [start:worker_main]
    @staticmethod
    def worker_main(**kwargs: Any) -> None:
        """The process's entry point: build the worker, say READY, serve calls."""
        shutdown_requested = threading.Event()

        def signal_handler(signum: int, frame: Any) -> None:
            # SystemExit once: the `finally` below runs, and a second signal
            # does not interrupt it.
            if not shutdown_requested.is_set():
                shutdown_requested.set()
                raise SystemExit()

        signal.signal(signal.SIGTERM, signal_handler)
        signal.signal(signal.SIGINT, signal_handler)
        ready_writer: Connection | None = kwargs.pop("ready_pipe")
        death_pipe: Connection = kwargs.pop("death_pipe")
        rank: int = kwargs["rank"]
        vllm_config: VllmConfig = kwargs["vllm_config"]
        # This rank's own TracerProvider; its spans join the step's trace, and
        # its resource says which ranks, heads and layers it holds.
        tracing.init_tracer(
            "worker",
            vllm_config.trace_config,
            vllm_config.observability_config,
            resource_attributes=worker_resource_attributes(vllm_config, rank),
        )
        worker: WorkerProc | None = None
        built: list[WorkerProc] = []
        # Watched from the start: a parent that dies while this rank loads.
        _watch_death_pipe(death_pipe, shutdown_requested, lambda: built)
        try:
            worker = WorkerProc(**kwargs)
            built.append(worker)
            assert worker.rpc_broadcast_mq is not None and worker.worker_response_mq is not None
            handle = worker.worker_response_mq.export_handle()
            ready_writer.send({"status": WorkerProc.READY_STR, "handle": handle})  # type: ignore[union-attr]
            # Collective with the executor's own calls (MultiprocExecutor._init_executor).
            worker.rpc_broadcast_mq.wait_until_ready(timeout=_QUEUE_READY_TIMEOUT_S)
            worker.worker_response_mq.wait_until_ready(timeout=_QUEUE_READY_TIMEOUT_S)
            ready_writer.close()  # type: ignore[union-attr]
            ready_writer = None
            worker.worker_busy_loop()
        except Exception as e:
            if ready_writer is not None:
                logger.exception("WorkerProc failed to start.")
                with suppress(OSError):
                    ready_writer.send({"status": "FAILED", "error": f"{type(e).__name__}: {e}"})
            elif shutdown_requested.is_set():
                logger.info("WorkerProc shutting down.")
            else:
                logger.exception("WorkerProc failed.")
            shutdown_requested.set()
        finally:
            if ready_writer is not None:
                ready_writer.close()
            tracing.flush_tracer()  # before a shutdown that may be cut short
            if worker is not None:
                worker.shutdown()
            tracing.shutdown_tracer()

    # --8<-- [end:worker_main]

    # --8<-- [start:worker_busy_loop]
    def worker_busy_loop(self) -> None:
        """Serve calls until the queue is shut down (RuntimeError: cancelled)."""
        assert self.rpc_broadcast_mq is not None
        while True:
            method, args, kwargs, output_rank, trace_headers = self.rpc_broadcast_mq.dequeue(
                indefinite=True
            )
            try:
                with tracing.trace_context(trace_headers):
                    output = run_method(self.worker, method, args, kwargs)
            except Exception as e:
                logger.exception("WorkerProc hit an exception.")
                output = e
                if method == "execute_model" and args[0].total_num_scheduled_tokens:
                    # The next pipeline stage waits for this step's tensors.
                    from tracevllm.distributed.parallel_state import send_pp_stage_failure

                    send_pp_stage_failure(self.rank, e)
            # A step's call is answered by the output rank alone.
            if output_rank is None or self.rank == output_rank:
                self.enqueue_output(output)

    # --8<-- [end:worker_busy_loop]

    def enqueue_output(self, output: Any) -> None:
        """An exception goes back as a FAILURE with its message (it may not pickle).

        An async step's output is waited for here (vLLM hands it to a thread,
        so that the worker goes on to the next step while the sampled tokens
        are copied to the host; on CPU there is no copy to wait for).
        """
        if isinstance(output, AsyncModelRunnerOutput):
            try:
                output = output.get_output()
            except Exception as e:
                output = e
        if isinstance(output, Exception):
            result = (WorkerProc.ResponseStatus.FAILURE, str(output))
        else:
            result = (WorkerProc.ResponseStatus.SUCCESS, output)
        assert self.worker_response_mq is not None
        self.worker_response_mq.enqueue(result)

    def queues(self) -> list[MessageQueue]:
        return [mq for mq in (self.rpc_broadcast_mq, self.worker_response_mq) if mq is not None]

    def shutdown(self) -> None:
        from tracevllm.distributed.parallel_state import (
            destroy_distributed_environment,
            destroy_model_parallel,
        )

        for mq in self.queues():
            mq.close()
        self.rpc_broadcast_mq = self.worker_response_mq = None
        self.worker.shutdown()
        destroy_model_parallel()
        destroy_distributed_environment()


def _watch_death_pipe(
    death_pipe: Connection,
    shutdown_requested: threading.Event,
    built: Callable[[], list[WorkerProc]],
) -> None:
    """A thread that waits for the death pipe's EOF, then wakes the busy loop
    (or, before the worker is built, interrupts its start-up)."""
    main_thread_id = threading.main_thread().ident
    assert main_thread_id is not None

    def watch() -> None:
        try:
            death_pipe.recv()  # nothing is ever sent: this returns at EOF only
        except EOFError:
            pass
        except OSError:
            return
        logger.info("The executor is gone or stopping: this worker leaves.")
        workers = built()
        if workers:
            shutdown_requested.set()
            for worker in workers:
                for mq in worker.queues():
                    mq.shutdown()
        else:
            # Still starting (loading the model, joining the groups): no queue
            # to wake, so interrupt the main thread itself; its SIGTERM handler
            # sets shutdown_requested and raises SystemExit there (tracevllm's;
            # vLLM's worker watches only once built).
            signal.pthread_kill(main_thread_id, signal.SIGTERM)
        # Still here? It is stuck where no queue wakes it: exit hard.
        time.sleep(ORPHAN_GRACE_S)
        logger.warning("Worker did not leave within %.0f s; exiting.", ORPHAN_GRACE_S)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="DeathPipeMonitor").start()
