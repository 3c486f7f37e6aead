"""How the frontend talks to EngineCore: in this process, or over ZeroMQ.

Mirrors vllm/v1/engine/core_client.py: ``EngineCoreClient.make_client`` picks
``SyncMPClient`` (EngineCore in a child process) or ``InprocClient``
(``TRACEVLLM_ENABLE_MULTIPROCESSING=0``: the same EngineCore in the caller's
process, for breakpoints); ``make_async_mp_client`` gives ``AsyncMPClient``,
the same process and wire driven from asyncio (what ``AsyncLLM`` and the
OpenAI server use). ``MPClient`` holds what the two share: the sockets, the
engine process (with ``data_parallel_size`` D > 1: D of them, ``DPEngineCoreProc``,
and the ``DPCoordinator``), its start-up and its death watch.
``DPLBAsyncMPClient`` (serving) and ``DPLBSyncMPClient`` (offline, tracevllm's)
send each request to the least-loaded engine. Left out: external and hybrid
DP load balancing, elastic scaling, zero-copy tensor frames.

The wire, as vLLM's: the frontend binds a ROUTER (input) and a PULL (output)
on ``ipc://`` paths in a private temp dir; the engine connects a DEALER and a
PUSH. Input frames are ``(identity, request_type_byte, msgpack(request))``.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from tracevllm import envs, tracing
from tracevllm.config import VllmConfig
from tracevllm.engine import EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType
from tracevllm.engine.coordinator import DPCoordinator
from tracevllm.engine.core import (
    ENGINE_CORE_DEAD,
    READY,
    EngineCore,
    EngineCoreProc,
    EngineCoreReadyResponse,
)
from tracevllm.engine.exceptions import EngineDeadError, describe_exit
from tracevllm.logger import init_logger
from tracevllm.serial_utils import MsgpackDecoder, MsgpackEncoder

logger = init_logger(__name__)


class EngineCoreClient:
    """The frontend's handle on EngineCore."""

    # Known after start-up (the READY response).
    num_gpu_blocks: int
    max_model_len: int
    kv_cache_block_limits: list[tuple[int, int]]

    @staticmethod
    def make_client(multiprocess_mode: bool, vllm_config: VllmConfig) -> EngineCoreClient:
        data_parallel = vllm_config.parallel_config.data_parallel_size > 1
        if multiprocess_mode:
            return DPLBSyncMPClient(vllm_config) if data_parallel else SyncMPClient(vllm_config)
        if data_parallel:
            raise ValueError(
                "data_parallel_size > 1 runs each engine core in its own process: "
                "it needs enable_multiprocessing=True (TRACEVLLM_ENABLE_MULTIPROCESSING=1)."
            )
        return InprocClient(vllm_config)

    @staticmethod
    def make_async_mp_client(vllm_config: VllmConfig) -> AsyncMPClient:
        if vllm_config.parallel_config.data_parallel_size > 1:
            return DPLBAsyncMPClient(vllm_config)
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

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """``method`` on every worker of the engine (vLLM's), by name."""
        name = _method_name(method)
        return list(self.call_utility("collective_rpc", name, timeout, tuple(args), kwargs))

    def shutdown(self) -> None:
        pass


def _method_name(method: str | Callable[..., Any]) -> str:
    """collective_rpc's method as it crosses to an engine process: a name. A
    function does not cross here (vLLM pickles one with cloudpickle only where
    insecure serialization is allowed)."""
    if not isinstance(method, str):
        raise TypeError(
            "collective_rpc: name a Worker method (a str) when the engine core runs "
            "in its own process; a function runs only with "
            "TRACEVLLM_ENABLE_MULTIPROCESSING=0"
        )
    return method


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

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        return self.engine_core.collective_rpc(method, timeout, args, kwargs)

    def shutdown(self) -> None:
        self.engine_core.shutdown()


class BackgroundResources:
    """Everything the MP client must release, kept apart from the client so a
    ``weakref.finalize`` can release it without holding the client alive."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.ctx = ctx
        self.proc: BaseProcess | None = None
        # Every engine process (D with data parallelism; proc is the first)
        # and the DP coordinator's.
        self.engine_procs: list[BaseProcess] = []
        self.coordinator_proc: BaseProcess | None = None
        # The DP client's thread that reads the coordinator's stats.
        self.stats_thread: threading.Thread | None = None
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
            for thread in (self.output_thread, self.monitor_thread, self.stats_thread):
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
        procs = [p for p in (*self.engine_procs, self.coordinator_proc) if p is not None]
        if self.proc is not None and self.proc not in procs:
            procs.append(self.proc)
        procs = [p for p in procs if p.is_alive()]
        # All told first, then waited for: D engines stop side by side.
        for proc in procs:
            if proc.pid is not None:
                # A stopped process (SIGSTOP, Ctrl-Z) would hold SIGTERM until it
                # continues: let it continue, so that it can exit.
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)
            proc.terminate()  # SIGTERM: the engine exits through its finally
        for proc in procs:
            proc.join(timeout=ENGINE_CORE_EXIT_TIMEOUT_S)
            if proc.is_alive():
                logger.warning("%s did not exit on SIGTERM; killing it.", proc.name)
                proc.kill()
                proc.join(timeout=5)


# How long an engine process has to exit on SIGTERM before it is killed
# (vLLM's shutdown() gives 5 s). Its own shutdown stops its workers, which
# takes up to 9 s when one does not leave (MultiprocExecutor's
# _ensure_worker_termination); it writes its spans out before that.
ENGINE_CORE_EXIT_TIMEOUT_S = 10.0

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
        # Data parallelism: D engines behind these same two sockets (the
        # ROUTER tells them apart by identity, the PULL merges their outputs)
        # and a coordinator between them and this frontend.
        dp_size = vllm_config.parallel_config.data_parallel_size
        dp_kwargs: dict[str, Any] = {}
        self.stats_update_address: str | None = None
        if dp_size > 1:
            coordinator = DPCoordinator(vllm_config.parallel_config, resources.socket_dir, mp)
            resources.coordinator_proc = coordinator.proc
            coord_in, coord_out = coordinator.get_engine_socket_addresses()
            dp_kwargs = dict(coordinator_input=coord_in, coordinator_output=coord_out)
            self.stats_update_address = coordinator.get_stats_publish_address()
        startup_errors: list[Connection] = []
        for index in range(dp_size):
            # The engine reports a start-up failure here (its exception, in words).
            startup_error_r, startup_error_w = mp.Pipe(duplex=False)
            proc = mp.Process(
                target=EngineCoreProc.run_engine_core,
                name="EngineCore" if dp_size == 1 else f"EngineCore_DP{index}",
                kwargs=dict(
                    vllm_config=vllm_config,
                    input_address=input_address,
                    output_address=output_address,
                    startup_error_pipe=startup_error_w,
                    **(dict(dp_rank=index, **dp_kwargs) if dp_size > 1 else {}),
                ),
                daemon=True,
            )
            proc.start()
            # --8<-- [end:mp_client_sockets]
            resources.engine_procs.append(proc)
            startup_error_w.close()
            startup_errors.append(startup_error_r)
        resources.proc = resources.engine_procs[0]
        try:
            readies = self._wait_for_engine_startup(
                input_socket, resources.engine_procs, startup_errors
            )
        except BaseException:
            resources()
            raise
        finally:
            for pipe in startup_errors:
                pipe.close()
        # The DEALERs' identities, in DP rank order.
        self.core_engines = [identity for identity, _ in readies]
        self.core_engine = self.core_engines[0]
        ready = readies[0][1]
        self.num_gpu_blocks = ready.num_gpu_blocks
        self.max_model_len = ready.max_model_len
        self.kv_cache_block_limits = [(g[0], g[1]) for g in ready.kv_cache_block_limits]
        self.engine_pids = [r.pid for _, r in readies]
        self.engine_pid = self.engine_pids[0]
        self.input_socket: Any = input_socket
        self.output_socket: Any = output_socket

    def _wait_for_engine_startup(
        self, input_socket: zmq.Socket, procs: list[BaseProcess], startup_errors: list[Connection]
    ) -> list[tuple[bytes, EngineCoreReadyResponse]]:
        """Wait for every engine's READY, but notice at once if one fails instead."""
        timeout_s = envs.TRACEVLLM_ENGINE_READY_TIMEOUT_S
        deadline = time.monotonic() + timeout_s
        poller = zmq.Poller()
        poller.register(input_socket, zmq.POLLIN)
        for proc, startup_error in zip(procs, startup_errors):
            poller.register(proc.sentinel, zmq.POLLIN)
            poller.register(startup_error.fileno(), zmq.POLLIN)
        readies: dict[bytes, EngineCoreReadyResponse] = {}
        decoder = MsgpackDecoder(EngineCoreReadyResponse)
        while len(readies) < len(procs):
            left_ms = int((deadline - time.monotonic()) * 1000)
            events = dict(poller.poll(timeout=max(left_ms, 0)))
            if input_socket in events:
                identity, status, payload = input_socket.recv_multipart()
                assert status == READY, f"expected READY from EngineCore, got {status!r}"
                readies[identity] = decoder.decode(payload)
                continue
            if not events:
                raise TimeoutError(
                    f"EngineCore did not report READY within {timeout_s:.0f}s "
                    "(TRACEVLLM_ENGINE_READY_TIMEOUT_S)."
                )
            # One failed: read its reason, and wait for the exit so the code is known.
            index = next(
                i
                for i, (p, e) in enumerate(zip(procs, startup_errors))
                if p.sentinel in events or e.fileno() in events
            )
            proc, startup_error = procs[index], startup_errors[index]
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
                f"{proc.name} failed to start (it {describe_exit(proc.exitcode)})"
                + (f": {reason}" if reason else "; see the engine process's error above.")
                + hint
            )
        # The identity is the DP rank, little-endian.
        return sorted(readies.items(), key=lambda item: int.from_bytes(item[0], "little"))

    # --8<-- [start:engine_core_monitor]
    def _start_engine_core_monitor(self, on_dead: Any) -> None:
        """Watch the process sentinels: a dead engine becomes EngineDeadError, not a hang.

        ``on_dead(error)`` hands the error to whoever waits for outputs. With
        data parallelism every engine is watched, and the coordinator: the
        error names the one that died.
        """
        resources = self.resources
        procs = [p for p in (*resources.engine_procs, resources.coordinator_proc) if p]
        utility_results = self.utility_results

        def monitor_engine_cores() -> None:
            sentinels = {p.sentinel: p for p in procs}
            ready = wait([*sentinels, resources.monitor_wake_r])
            dead = [sentinels[s] for s in ready if s in sentinels]
            if resources.shutting_down or not dead:
                return
            resources.engine_dead = True
            proc = dead[0]
            proc.join(timeout=5)  # reap it, so the exit code is known
            reason = f"{proc.name} process (pid {proc.pid}) {describe_exit(proc.exitcode)}."
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

    def _encode(
        self, request_type: EngineCoreRequestType, request: Any, engine: bytes | None = None
    ) -> tuple[Any, ...]:
        """The frames for one engine (the first, unless ``engine`` names another)."""
        self.ensure_alive()
        engine = self.core_engine if engine is None else engine
        return (engine, request_type.value, self.encoder.encode(request))

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


# --- data parallelism --------------------------------------------------------------
class DPLoadBalancer:
    """What the DP clients share: the least-loaded choice, the in-flight
    requests' engines, and the coordinator's view (kept up to date by a
    thread that holds this object, never the client).

    vLLM keeps these on ``DPAsyncMPClient`` / ``DPLBAsyncMPClient`` and reads
    the coordinator in an asyncio task; here a thread does it for the sync
    client and the asyncio one alike.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        resources: BackgroundResources,
        core_engines: list[bytes],
        stats_update_address: str,
    ) -> None:
        self.core_engines = core_engines
        # [waiting, running] per engine, from the coordinator (plus the
        # requests sent since its last word).
        self.lb_engines: list[list[int]] = [[0, 0] for _ in core_engines]
        self.current_wave = 0
        self.engines_running = False
        # request id -> the engine it went to (aborts go there too).
        self.reqs_in_flight: dict[str, bytes] = {}
        # vLLM's client_count / client_index: one frontend here.
        self.client_count = 1
        self.eng_start_index = 0
        # Sends "this engine got the first request of a wave" to the stats
        # thread, which owns the socket to the coordinator.
        first_req_addr = f"inproc://first-req-{uuid.uuid4().hex}"
        self.first_req_send_socket = ctx.socket(zmq.PAIR)
        self.first_req_send_socket.setsockopt(zmq.LINGER, 0)
        self.first_req_send_socket.bind(first_req_addr)
        resources.sockets.append(self.first_req_send_socket)
        subscribed = threading.Event()
        thread = threading.Thread(
            target=_run_engine_stats_update,
            args=(self, ctx, resources, stats_update_address, first_req_addr, subscribed),
            name="DPEngineStatsUpdateThread",
            daemon=True,
        )
        thread.start()
        resources.stats_thread = thread
        subscribed.wait(5)

    def get_core_engine_for_request(self, request: EngineCoreRequest) -> bytes:
        """The least-loaded engine (waiting x 4 + running, as vLLM scores it);
        the request carries the wave this frontend knows."""
        request.current_wave = self.current_wave
        current_counts = self.lb_engines
        num_engines = len(current_counts)
        min_score, eng_index = sys.maxsize, 0
        for i in range(num_engines):
            # Start from this client's index: spreads ties when all are empty.
            idx = (self.eng_start_index + i) % num_engines
            waiting, running = current_counts[idx]
            score = waiting * 4 + running
            if score < min_score:
                min_score, eng_index = score, idx
        # Counted here until the coordinator's next update (every 100 ms).
        current_counts[eng_index][0] += self.client_count
        chosen_engine = self.core_engines[eng_index]
        self.reqs_in_flight[request.request_id] = chosen_engine
        if not self.engines_running:
            # The engines are idle: the coordinator wakes the others into the wave.
            self.engines_running = True
            self.first_req_send_socket.send(msgspec.msgpack.encode(("FIRST_REQ", eng_index)))
        return chosen_engine

    def process_engine_outputs(self, outputs: EngineCoreOutputs) -> None:
        if self.reqs_in_flight:
            for output in outputs.outputs:
                if output.finish_reason is not None:
                    self.reqs_in_flight.pop(output.request_id, None)

    def requests_by_engine(self, request_ids: list[str]) -> dict[bytes, list[str]]:
        """Aborted requests, grouped by the engine that has them (forgotten here)."""
        by_engine: dict[bytes, list[str]] = {}
        for req_id in request_ids:
            if (engine := self.reqs_in_flight.pop(req_id, None)) is not None:
                by_engine.setdefault(engine, []).append(req_id)
        return by_engine


def _run_engine_stats_update(
    balancer: DPLoadBalancer,
    ctx: zmq.Context,
    resources: BackgroundResources,
    stats_addr: str,
    first_req_addr: str,
    subscribed: threading.Event,
) -> None:
    """The stats thread: the coordinator's (counts, wave, running) into the
    balancer, and FIRST_REQ notices up to the coordinator."""
    socket = ctx.socket(zmq.XSUB)
    first_req_rcv_socket = ctx.socket(zmq.PAIR)
    try:
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(stats_addr)
        socket.send(b"\x01")  # subscribe to everything
        first_req_rcv_socket.setsockopt(zmq.LINGER, 0)
        first_req_rcv_socket.connect(first_req_addr)
        subscribed.set()
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        poller.register(first_req_rcv_socket, zmq.POLLIN)
        while not resources.shutting_down:
            # A timeout, so that shutdown (which joins this thread) is seen.
            events = dict(poller.poll(timeout=int(IDLE_POLL_S * 1000)))
            if first_req_rcv_socket in events:
                _, eng_index = msgspec.msgpack.decode(first_req_rcv_socket.recv())
                socket.send(msgspec.msgpack.encode((eng_index, balancer.current_wave)))
            if socket not in events:
                continue
            buf = None
            while True:  # only the latest update matters
                try:
                    buf = socket.recv(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
            if buf is None:
                continue
            counts, wave, running = msgspec.msgpack.decode(buf)
            balancer.current_wave = wave
            balancer.engines_running = running
            if counts is not None:
                balancer.lb_engines = counts
    except zmq.ContextTerminated:
        pass
    except Exception:
        logger.exception("DP stats update thread failed.")
    finally:
        subscribed.set()
        socket.close(linger=0)
        first_req_rcv_socket.close(linger=0)


# How often the DP stats thread checks for shutdown (seconds).
IDLE_POLL_S = 0.2


class DPLBSyncMPClient(SyncMPClient):
    """D engine processes behind blocking calls: the offline ``LLM``'s client.

    tracevllm's: vLLM's offline DP runs one ``LLM`` per DP rank (each its own
    process, SPMD); here one ``LLM`` drives all D engines, as the serving
    client does, and sends each request to the least-loaded one. Outputs of
    every engine arrive merged on the one PULL socket.
    """

    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__(vllm_config)
        assert self.stats_update_address is not None
        try:
            self.balancer = DPLoadBalancer(
                self.ctx, self.resources, self.core_engines, self.stats_update_address
            )
        except BaseException:
            self.shutdown()
            raise

    def get_output(self) -> EngineCoreOutputs:
        outputs = super().get_output()
        self.balancer.process_engine_outputs(outputs)
        return outputs

    @tracing.instrument("DPLBSyncMPClient.add_request")
    def add_request(self, request: EngineCoreRequest) -> None:
        self.ensure_alive()
        engine = self.balancer.get_core_engine_for_request(request)
        frames = self._encode(EngineCoreRequestType.ADD, request, engine)
        self.input_socket.send_multipart(frames, copy=False)

    def abort_requests(self, request_ids: list[str]) -> None:
        if not request_ids or self.resources.engine_dead:
            return
        for engine, req_ids in self.balancer.requests_by_engine(request_ids).items():
            frames = self._encode(EngineCoreRequestType.ABORT, req_ids, engine)
            self.input_socket.send_multipart(frames, copy=False)

    def call_utility(self, method: str, *args: Any) -> Any:
        """The first engine's answer (as vLLM's DP clients); every engine is called."""
        return self.call_utility_all(method, *args)[0]

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Every worker of every engine: DP rank 0's workers' answers first
        (vLLM's LLM drives one engine, so its list is one engine's)."""
        name = _method_name(method)
        answers = self.call_utility_all("collective_rpc", name, timeout, tuple(args), kwargs)
        return [a for engine in answers for a in engine]

    def call_utility_all(self, method: str, *args: Any) -> list[Any]:
        """Call ``method`` on every engine; their answers in DP rank order."""
        futures = []
        for engine in self.core_engines:
            call, future = self._utility_future(method, args)
            frames = self._encode(EngineCoreRequestType.UTILITY, call, engine)
            self.input_socket.send_multipart(frames, copy=False)
            futures.append(future)
        return [f.result() for f in futures]


class DPLBAsyncMPClient(AsyncMPClient):
    """D engine processes driven from asyncio (``AsyncLLM``, the server):
    each request goes to the least-loaded engine, by the coordinator's
    counts. vLLM's ``DPAsyncMPClient`` (one engine per frontend, external
    load balancing) is folded in: tracevllm has the internal balancer only."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__(vllm_config)
        assert self.stats_update_address is not None
        try:
            self.balancer = DPLoadBalancer(
                self.ctx, self.resources, self.core_engines, self.stats_update_address
            )
        except BaseException:
            self.shutdown()
            raise

    async def get_output_async(self) -> EngineCoreOutputs:
        outputs = await super().get_output_async()
        self.balancer.process_engine_outputs(outputs)
        return outputs

    @tracing.instrument("DPLBAsyncMPClient.add_request_async")
    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self.ensure_alive()
        engine = self.balancer.get_core_engine_for_request(request)
        frames = self._encode(EngineCoreRequestType.ADD, request, engine)
        await self.input_socket.send_multipart(frames, copy=False)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if not request_ids or self.resources.engine_dead:
            return
        for engine, req_ids in self.balancer.requests_by_engine(request_ids).items():
            frames = self._encode(EngineCoreRequestType.ABORT, req_ids, engine)
            await self.input_socket.send_multipart(frames, copy=False)

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        """The first engine's answer (as vLLM's); every engine is called."""
        return (await self.call_utility_all_async(method, *args))[0]

    async def call_utility_all_async(self, method: str, *args: Any) -> list[Any]:
        futures = []
        for engine in self.core_engines:
            call, future = self._utility_future(method, args)
            frames = self._encode(EngineCoreRequestType.UTILITY, call, engine)
            await self.input_socket.send_multipart(frames, copy=False)
            futures.append(asyncio.wrap_future(future))
        return list(await asyncio.gather(*futures))


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
