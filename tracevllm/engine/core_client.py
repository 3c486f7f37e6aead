"""How the frontend talks to EngineCore: in this process, or over ZeroMQ.

Mirrors vllm/v1/engine/core_client.py: ``EngineCoreClient.make_client`` picks
``SyncMPClient`` (EngineCore in a child process) or ``InprocClient``
(``TRACEVLLM_ENABLE_MULTIPROCESSING=0``: the same EngineCore in the caller's
process, for breakpoints); ``make_async_mp_client`` gives ``AsyncMPClient``,
the same process and wire driven from asyncio (what ``AsyncLLM`` and the
OpenAI server use). ``MPClient`` holds what the two share: the sockets, the
engine process, its start-up and its death watch. Left out: data-parallel
clients, elastic scaling, zero-copy tensor frames.

The wire, as vLLM's: the frontend binds a ROUTER (input) and a PULL (output)
on ``ipc://`` paths in a private temp dir; the engine connects a DEALER and a
PUSH. Input frames are ``(identity, request_type_byte, msgpack(request))``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import queue
import shutil
import signal
import sys
import tempfile
import threading
import uuid
import weakref
from concurrent.futures import Future
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import zmq
import zmq.asyncio

from tracevllm import envs, tracing
from tracevllm.config import VllmConfig
from tracevllm.engine import EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType
from tracevllm.engine.core import (
    ENGINE_CORE_DEAD,
    READY,
    EngineCore,
    EngineCoreProc,
    EngineCoreReadyResponse,
)
from tracevllm.engine.exceptions import EngineDeadError, describe_exit
from tracevllm.serial_utils import MsgpackDecoder, MsgpackEncoder

logger = logging.getLogger(__name__)


class EngineCoreClient:
    """The frontend's handle on EngineCore."""

    # Known after start-up (the READY response).
    num_gpu_blocks: int
    max_model_len: int
    kv_cache_block_limits: list[tuple[int, int]]

    @staticmethod
    def make_client(multiprocess_mode: bool, vllm_config: VllmConfig) -> EngineCoreClient:
        if multiprocess_mode:
            return SyncMPClient(vllm_config)
        return InprocClient(vllm_config)

    @staticmethod
    def make_async_mp_client(vllm_config: VllmConfig) -> AsyncMPClient:
        return AsyncMPClient(vllm_config)

    def get_output(self) -> EngineCoreOutputs:
        raise NotImplementedError

    def add_request(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError

    def abort_requests(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    def call_utility(self, method: str, *args: Any) -> Any:
        raise NotImplementedError

    def reset_prefix_cache(self) -> bool:
        return bool(self.call_utility("reset_prefix_cache"))

    def get_kv_cache_stats(self) -> dict[str, int]:
        return dict(self.call_utility("get_kv_cache_stats"))

    def shutdown(self) -> None:
        pass


class InprocClient(EngineCoreClient):
    """EngineCore in this process: ``get_output`` runs one step and returns it."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        self.engine_core = EngineCore(vllm_config)
        self.num_gpu_blocks = vllm_config.cache_config.num_gpu_blocks or 0
        self.max_model_len = vllm_config.model_config.get_max_model_len()
        self.kv_cache_block_limits = self.engine_core.kv_cache_block_limits

    @tracing.instrument("InprocClient.get_output")
    def get_output(self) -> EngineCoreOutputs:
        try:
            outputs, model_executed = self.engine_core.step_fn()
        except BaseException:
            # An error or a Ctrl-C mid-step: leave the core consistent, then raise.
            self.engine_core.abort_all_after_failed_step()
            raise
        self.engine_core.post_step(model_executed)
        # None: the step was only scheduled (the batch queue had room).
        return (outputs or {}).get(0) or EngineCoreOutputs()

    @tracing.instrument("InprocClient.add_request")
    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(self.engine_core.preprocess_add_request(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def call_utility(self, method: str, *args: Any) -> Any:
        return getattr(self.engine_core, method)(*args)

    def shutdown(self) -> None:
        self.engine_core.shutdown()


class BackgroundResources:
    """Everything the MP client must release, kept apart from the client so a
    ``weakref.finalize`` can release it without holding the client alive."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.ctx = ctx
        self.proc: BaseProcess | None = None
        self.socket_dir: str | None = None
        self.sockets: list[zmq.Socket] = []
        self.shutdown_path: str | None = None
        self.output_thread: threading.Thread | None = None
        self.output_queue_task: asyncio.Task[None] | None = None
        self.monitor_thread: threading.Thread | None = None
        self.engine_dead = False
        self.shutting_down = False
        # Wakes the monitor thread at shutdown.
        self.monitor_wake_r, self.monitor_wake_w = multiprocessing.Pipe(duplex=False)

    def __call__(self) -> None:
        """Stop the engine process, the threads and the sockets; remove the socket dir.

        Idempotent, and the socket dir goes even if a second Ctrl-C lands
        half-way (the engine process also removes it on its way out).
        """
        if self.shutting_down:
            return
        self.shutting_down = True
        try:
            self.monitor_wake_w.send(None)
            if (task := self.output_queue_task) is not None:
                # Cancelled in its own loop (shutdown may run in another thread).
                with contextlib.suppress(RuntimeError):
                    task.get_loop().call_soon_threadsafe(task.cancel)
            self._stop_process()
            if self.shutdown_path is not None:
                # Tell the output thread to stop polling and close its socket.
                with self.ctx.socket(zmq.PAIR) as s:
                    s.setsockopt(zmq.LINGER, 0)
                    s.connect(self.shutdown_path)
                    s.send(b"")
            for thread in (self.output_thread, self.monitor_thread):
                if thread is not None and thread is not threading.current_thread():
                    thread.join(timeout=5)
        finally:
            if self.socket_dir is not None:
                shutil.rmtree(self.socket_dir, ignore_errors=True)
            for socket in self.sockets:
                socket.close(linger=0)
            self.ctx.destroy(linger=0)
            self.monitor_wake_r.close()
            self.monitor_wake_w.close()

    def _stop_process(self) -> None:
        proc = self.proc
        if proc is None or not proc.is_alive():
            return
        if proc.pid is not None:
            # A stopped process (SIGSTOP, Ctrl-Z) would hold SIGTERM until it
            # continues: let it continue, so that it can exit.
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()  # SIGTERM: the engine exits through its finally
        proc.join(timeout=10)
        if proc.is_alive():
            logger.warning("EngineCore did not exit on SIGTERM; killing it.")
            proc.kill()
            proc.join(timeout=5)


# Why the engine stopped, when it says so itself (ENGINE_CORE_DEAD).
_FATAL_STEP_ERROR = (
    "EngineCore hit a fatal error in a step and stopped{}; its traceback is in the "
    "engine process's log above."
)


def _process_output_frame(
    frame: bytes,
    deliver: Any,
    resources: BackgroundResources,
    decoder: MsgpackDecoder,
    utility_results: dict[int, Future[Any]],
) -> None:
    """One frame from the PULL socket: outputs go to ``deliver``, a utility
    result to its future, a death notice becomes EngineDeadError. (A function,
    not a method: the reader thread or task must not keep the client alive.)"""
    if frame.startswith(ENGINE_CORE_DEAD):  # an output frame is msgpack: never this
        resources.engine_dead = True
        reason = bytes(frame[len(ENGINE_CORE_DEAD) :]).decode(errors="replace")
        deliver(EngineDeadError(_FATAL_STEP_ERROR.format(f" ({reason})" if reason else "")))
        return
    outputs: EngineCoreOutputs = decoder.decode(frame)
    if outputs.utility_output is None:
        deliver(outputs)
        return
    uo = outputs.utility_output
    future = utility_results.pop(uo.call_id)
    if uo.failure_message is not None:
        future.set_exception(Exception(uo.failure_message))
    else:
        future.set_result(uo.result)


class MPClient(EngineCoreClient):
    """EngineCore in a child process, reached over ZeroMQ.

    Starts the process and waits for its READY; ``SyncMPClient`` and
    ``AsyncMPClient`` add how outputs are read (a thread, or an asyncio task).
    """

    def __init__(self, asyncio_mode: bool, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config
        self.encoder = MsgpackEncoder()
        self.decoder = MsgpackDecoder(EngineCoreOutputs)
        self.ctx = zmq.Context(io_threads=1)
        self.resources = resources = BackgroundResources(self.ctx)
        self._finalizer = weakref.finalize(self, resources)
        # call_id -> the future of a utility call in flight.
        self.utility_results: dict[int, Future[Any]] = {}

        # --8<-- [start:mp_client_sockets]
        # Private temp dir: the ipc:// socket files live (and die) there.
        resources.socket_dir = tempfile.mkdtemp(prefix="tracevllm-")
        input_address = f"ipc://{resources.socket_dir}/input-{uuid.uuid4().hex[:8]}"
        output_address = f"ipc://{resources.socket_dir}/output-{uuid.uuid4().hex[:8]}"
        input_socket = self.ctx.socket(zmq.ROUTER)
        input_socket.setsockopt(zmq.LINGER, 0)
        input_socket.bind(input_address)
        output_socket = self.ctx.socket(zmq.PULL)
        output_socket.setsockopt(zmq.LINGER, 0)
        output_socket.bind(output_address)
        resources.sockets += [input_socket, output_socket]

        self.mp_method = _get_mp_method()
        mp: Any = multiprocessing.get_context(self.mp_method)
        # The engine reports a start-up failure here (its exception, in words).
        startup_error_r, startup_error_w = mp.Pipe(duplex=False)
        proc = mp.Process(
            target=EngineCoreProc.run_engine_core,
            name="EngineCore",
            kwargs=dict(
                vllm_config=vllm_config,
                input_address=input_address,
                output_address=output_address,
                startup_error_pipe=startup_error_w,
            ),
            daemon=True,
        )
        proc.start()
        # --8<-- [end:mp_client_sockets]
        resources.proc = proc
        startup_error_w.close()
        try:
            ready = self._wait_for_engine_startup(input_socket, proc, startup_error_r)
        except BaseException:
            resources()
            raise
        finally:
            startup_error_r.close()
        self.core_engine = ready[0]  # the DEALER's identity
        self.num_gpu_blocks = ready[1].num_gpu_blocks
        self.max_model_len = ready[1].max_model_len
        self.kv_cache_block_limits = [(g[0], g[1]) for g in ready[1].kv_cache_block_limits]
        self.engine_pid = ready[1].pid
        self.input_socket: Any = input_socket
        self.output_socket: Any = output_socket

    def _wait_for_engine_startup(
        self, input_socket: zmq.Socket, proc: BaseProcess, startup_error: Connection
    ) -> tuple[bytes, EngineCoreReadyResponse]:
        """Wait for READY, but notice at once if the process fails instead."""
        timeout_s = envs.TRACEVLLM_ENGINE_READY_TIMEOUT_S
        poller = zmq.Poller()
        poller.register(input_socket, zmq.POLLIN)
        poller.register(proc.sentinel, zmq.POLLIN)
        poller.register(startup_error.fileno(), zmq.POLLIN)
        events = dict(poller.poll(timeout=int(timeout_s * 1000)))
        if input_socket in events:
            identity, status, payload = input_socket.recv_multipart()
            assert status == READY, f"expected READY from EngineCore, got {status!r}"
            return identity, MsgpackDecoder(EngineCoreReadyResponse).decode(payload)
        if not events:
            raise TimeoutError(
                f"EngineCore did not report READY within {timeout_s:.0f}s "
                "(TRACEVLLM_ENGINE_READY_TIMEOUT_S)."
            )
        # It failed: read its reason, and wait for the exit so the code is known.
        reason = ""
        with contextlib.suppress(EOFError, OSError):
            if startup_error.poll(5):
                reason = startup_error.recv()
        proc.join(timeout=10)
        hint = ""
        if not reason and self.mp_method == "spawn":
            hint = (
                " The engine process was started with spawn (torch was already imported), "
                "which runs your script's top level again in it: if your script has no "
                "`if __name__ == '__main__':` guard, add one."
            )
        raise RuntimeError(
            f"EngineCore failed to start (it {describe_exit(proc.exitcode)})"
            + (f": {reason}" if reason else "; see the engine process's error above.")
            + hint
        )

    # --8<-- [start:engine_core_monitor]
    def _start_engine_core_monitor(self, on_dead: Any) -> None:
        """Watch the process sentinel: a dead engine becomes EngineDeadError, not a hang.

        ``on_dead(error)`` hands the error to whoever waits for outputs.
        """
        resources = self.resources
        proc = resources.proc
        assert proc is not None
        utility_results = self.utility_results

        def monitor_engine_cores() -> None:
            ready = wait([proc.sentinel, resources.monitor_wake_r])
            if resources.shutting_down or proc.sentinel not in ready:
                return
            resources.engine_dead = True
            proc.join(timeout=5)  # reap it, so the exit code is known
            reason = f"EngineCore process (pid {proc.pid}) {describe_exit(proc.exitcode)}."
            logger.error(reason)
            on_dead(EngineDeadError(reason))
            for future in list(utility_results.values()):
                if not future.done():  # the reader may have just resolved it
                    future.set_exception(EngineDeadError(reason))

        thread = threading.Thread(
            target=monitor_engine_cores, name="EngineCoreMonitor", daemon=True
        )
        thread.start()
        resources.monitor_thread = thread

    # --8<-- [end:engine_core_monitor]

    def ensure_alive(self) -> None:
        if self.resources.shutting_down:
            raise RuntimeError("The engine has been shut down; create a new LLM.")
        if self.resources.engine_dead:
            raise EngineDeadError()

    def _utility_future(self, method: str, args: tuple[Any, ...]) -> tuple[Any, Future[Any]]:
        call_id = uuid.uuid1().int >> 64
        future: Future[Any] = Future()
        self.utility_results[call_id] = future
        return (0, call_id, method, args), future

    def _encode(self, request_type: EngineCoreRequestType, request: Any) -> tuple[Any, ...]:
        self.ensure_alive()
        return (self.core_engine, request_type.value, self.encoder.encode(request))

    def shutdown(self) -> None:
        self._finalizer()


class SyncMPClient(MPClient):
    """EngineCore in a child process, reached over ZeroMQ; blocking calls."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__(asyncio_mode=False, vllm_config=vllm_config)
        self.outputs_queue: queue.Queue[EngineCoreOutputs | Exception] = queue.Queue()
        self._start_output_thread(self.output_socket)
        self._start_engine_core_monitor(self.outputs_queue.put_nowait)

    def _start_output_thread(self, out_socket: zmq.Socket) -> None:
        """A thread polls PULL (and an inproc shutdown socket) into outputs_queue."""
        ctx, resources, outputs_queue = self.ctx, self.resources, self.outputs_queue
        decoder, utility_results = self.decoder, self.utility_results
        shutdown_path = f"inproc://shutdown-{uuid.uuid4().hex}"
        resources.shutdown_path = shutdown_path
        bound = threading.Event()

        def process_outputs_socket() -> None:
            shutdown_socket = ctx.socket(zmq.PAIR)
            try:
                shutdown_socket.bind(shutdown_path)
                bound.set()
                poller = zmq.Poller()
                poller.register(shutdown_socket, zmq.POLLIN)
                poller.register(out_socket, zmq.POLLIN)
                while True:
                    socks = dict(poller.poll())
                    if shutdown_socket in socks:
                        # Whoever still waits (a generate in another thread
                        # when shutdown() stopped an engine that did not
                        # answer) wakes with an error, as AsyncMPClient's.
                        closed = EngineDeadError("The engine client was shut down.")
                        outputs_queue.put_nowait(closed)
                        for future in list(utility_results.values()):
                            if not future.done():
                                future.set_exception(closed)
                        break
                    _process_output_frame(
                        out_socket.recv(),
                        outputs_queue.put_nowait,
                        resources,
                        decoder,
                        utility_results,
                    )
            except Exception as e:
                outputs_queue.put_nowait(e)
            finally:
                bound.set()
                shutdown_socket.close(linger=0)

        thread = threading.Thread(
            target=process_outputs_socket, name="EngineCoreOutputQueueThread", daemon=True
        )
        thread.start()
        bound.wait()
        resources.output_thread = thread

    @tracing.instrument("SyncMPClient.get_output")
    def get_output(self) -> EngineCoreOutputs:
        # Blocks while the engine process computes: in a trace this span is
        # the frontend waiting on the other side of the boundary. A dead
        # engine ends the wait (the monitor thread); a hung one cannot, so
        # say so every TRACEVLLM_ENGINE_ITERATION_TIMEOUT_S while it lasts.
        waited = 0.0
        while True:
            timeout = envs.TRACEVLLM_ENGINE_ITERATION_TIMEOUT_S
            try:
                outputs = self.outputs_queue.get(timeout=timeout)
                break
            except queue.Empty:
                waited += timeout
                logger.warning(
                    "No output from EngineCore (pid %s) for %.0f s while requests are "
                    "in flight: it may be stopped (SIGSTOP, Ctrl-Z), swapping or stuck. "
                    "Still waiting; Ctrl-C to stop.",
                    self.engine_pid,
                    waited,
                )
        if isinstance(outputs, Exception):
            raise outputs
        return outputs

    def _send_input(self, request_type: EngineCoreRequestType, request: Any) -> None:
        self.input_socket.send_multipart(self._encode(request_type, request), copy=False)

    @tracing.instrument("SyncMPClient.add_request")
    def add_request(self, request: EngineCoreRequest) -> None:
        """Send the request over ZeroMQ (its trace context rides in trace_headers)."""
        self._send_input(EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self.resources.engine_dead:
            self._send_input(EngineCoreRequestType.ABORT, request_ids)

    def call_utility(self, method: str, *args: Any) -> Any:
        call, future = self._utility_future(method, args)
        self._send_input(EngineCoreRequestType.UTILITY, call)
        return future.result()


class AsyncMPClient(MPClient):
    """The same engine process and wire, driven from asyncio (``AsyncLLM``).

    The sockets are asyncio ZeroMQ sockets; a task reads the PULL socket into
    an ``asyncio.Queue``. Make it inside the event loop that will use it.
    """

    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__(asyncio_mode=True, vllm_config=vllm_config)
        # The same sockets, now awaitable.
        self.input_socket = zmq.asyncio.Socket.from_socket(self.input_socket)
        self.output_socket = zmq.asyncio.Socket.from_socket(self.output_socket)
        self.outputs_queue: asyncio.Queue[EngineCoreOutputs | Exception] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        queue_ = self.outputs_queue
        self._start_engine_core_monitor(
            lambda error: loop.call_soon_threadsafe(queue_.put_nowait, error)
        )
        self._ensure_output_queue_task()

    # --8<-- [start:async_output_queue_task]
    def _ensure_output_queue_task(self) -> None:
        resources = self.resources
        if resources.output_queue_task is not None:
            return
        # The task must not hold the client (weakref.finalize shuts it down).
        output_socket, outputs_queue = self.output_socket, self.outputs_queue
        decoder, utility_results = self.decoder, self.utility_results

        async def process_outputs_socket() -> None:
            try:
                while True:
                    frame = await output_socket.recv()
                    _process_output_frame(
                        frame, outputs_queue.put_nowait, resources, decoder, utility_results
                    )
            except asyncio.CancelledError:
                outputs_queue.put_nowait(EngineDeadError("The engine client was shut down."))
            except Exception as e:
                outputs_queue.put_nowait(e)

        resources.output_queue_task = asyncio.create_task(
            process_outputs_socket(), name="EngineCoreOutputQueueTask"
        )

    # --8<-- [end:async_output_queue_task]

    async def get_output_async(self) -> EngineCoreOutputs:
        """The next batch of outputs (the output handler waits here, idle or
        not); a dead engine raises EngineDeadError."""
        outputs = await self.outputs_queue.get()
        if isinstance(outputs, Exception):
            raise outputs
        return outputs

    async def _send_input_async(self, request_type: EngineCoreRequestType, request: Any) -> None:
        await self.input_socket.send_multipart(self._encode(request_type, request), copy=False)

    @tracing.instrument("AsyncMPClient.add_request_async")
    async def add_request_async(self, request: EngineCoreRequest) -> None:
        await self._send_input_async(EngineCoreRequestType.ADD, request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids and not self.resources.engine_dead:
            await self._send_input_async(EngineCoreRequestType.ABORT, request_ids)

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        call, future = self._utility_future(method, args)
        await self._send_input_async(EngineCoreRequestType.UTILITY, call)
        return await asyncio.wrap_future(future)


def _get_mp_method() -> str:
    """fork is fast (no re-import of torch); spawn is safe once torch is loaded
    here, because a forked child hangs on an OpenMP pool its parent started."""
    method = envs.TRACEVLLM_WORKER_MULTIPROC_METHOD
    if method == "auto":
        return "spawn" if "torch" in sys.modules else "fork"
    if method not in ("fork", "spawn", "forkserver"):
        raise ValueError(
            "TRACEVLLM_WORKER_MULTIPROC_METHOD must be fork, spawn, forkserver or auto, "
            f"got {method!r}."
        )
    return method


def get_engine_pid(client: EngineCoreClient) -> int:
    """The pid that runs EngineCore (this one, in-process)."""
    return getattr(client, "engine_pid", os.getpid())
