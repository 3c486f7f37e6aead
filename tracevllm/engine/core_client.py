"""How the frontend talks to EngineCore: in this process, or over ZeroMQ.

Mirrors vllm/v1/engine/core_client.py: ``EngineCoreClient.make_client`` picks
``SyncMPClient`` (EngineCore in a child process) or ``InprocClient``
(``TRACEVLLM_ENABLE_MULTIPROCESSING=0``: the same EngineCore in the caller's
process, for breakpoints). Left out: the asyncio client, data-parallel
clients, elastic scaling.

The wire, as vLLM's: the frontend binds a ROUTER (input) and a PULL (output)
on ``ipc://`` paths in a private temp dir; the engine connects a DEALER and a
PUSH. Input frames are ``(identity, request_type_byte, msgpack(request))``.
"""

from __future__ import annotations

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

    @staticmethod
    def make_client(multiprocess_mode: bool, vllm_config: VllmConfig) -> EngineCoreClient:
        if multiprocess_mode:
            return SyncMPClient(vllm_config)
        return InprocClient(vllm_config)

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

    @tracing.instrument("InprocClient.get_output")
    def get_output(self) -> EngineCoreOutputs:
        try:
            outputs, model_executed = self.engine_core.step_fn()
        except BaseException:
            # An error or a Ctrl-C mid-step: leave the core consistent, then raise.
            self.engine_core.abort_all_after_failed_step()
            raise
        self.engine_core.post_step(model_executed)
        return outputs.get(0) or EngineCoreOutputs()

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
        self.input_socket: zmq.Socket | None = None
        self.shutdown_path: str | None = None
        self.output_thread: threading.Thread | None = None
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
            if self.input_socket is not None:
                self.input_socket.close(linger=0)
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


class SyncMPClient(EngineCoreClient):
    """EngineCore in a child process, reached over ZeroMQ; blocking calls."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config
        self.encoder = MsgpackEncoder()
        self.decoder = MsgpackDecoder(EngineCoreOutputs)
        self.ctx = zmq.Context(io_threads=1)
        self.resources = resources = BackgroundResources(self.ctx)
        self._finalizer = weakref.finalize(self, resources)
        self.outputs_queue: queue.Queue[EngineCoreOutputs | Exception] = queue.Queue()
        self.utility_results: dict[int, Future[Any]] = {}

        # --8<-- [start:mp_client_sockets]
        # Private temp dir: the ipc:// socket files live (and die) there.
        resources.socket_dir = tempfile.mkdtemp(prefix="tracevllm-")
        input_address = f"ipc://{resources.socket_dir}/input-{uuid.uuid4().hex[:8]}"
        output_address = f"ipc://{resources.socket_dir}/output-{uuid.uuid4().hex[:8]}"
        self.input_socket = resources.input_socket = self.ctx.socket(zmq.ROUTER)
        self.input_socket.setsockopt(zmq.LINGER, 0)
        self.input_socket.bind(input_address)
        output_socket = self.ctx.socket(zmq.PULL)
        output_socket.setsockopt(zmq.LINGER, 0)
        output_socket.bind(output_address)

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
            ready = self._wait_for_engine_startup(proc, startup_error_r)
        except BaseException:
            resources()
            raise
        finally:
            startup_error_r.close()
        self.core_engine = ready[0]  # the DEALER's identity
        self.num_gpu_blocks = ready[1].num_gpu_blocks
        self.max_model_len = ready[1].max_model_len
        self.engine_pid = ready[1].pid

        self._start_output_thread(output_socket)
        self._start_engine_core_monitor()

    def _wait_for_engine_startup(
        self, proc: BaseProcess, startup_error: Connection
    ) -> tuple[bytes, EngineCoreReadyResponse]:
        """Wait for READY, but notice at once if the process fails instead."""
        timeout_s = envs.TRACEVLLM_ENGINE_READY_TIMEOUT_S
        poller = zmq.Poller()
        poller.register(self.input_socket, zmq.POLLIN)
        poller.register(proc.sentinel, zmq.POLLIN)
        poller.register(startup_error.fileno(), zmq.POLLIN)
        events = dict(poller.poll(timeout=int(timeout_s * 1000)))
        if self.input_socket in events:
            identity, status, payload = self.input_socket.recv_multipart()
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

    def _start_output_thread(self, out_socket: zmq.Socket) -> None:
        """A thread polls PULL (and an inproc shutdown socket) into outputs_queue."""
        ctx, decoder, resources = self.ctx, self.decoder, self.resources
        outputs_queue, utility_results = self.outputs_queue, self.utility_results
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
                        break
                    frame = out_socket.recv(copy=False)
                    if frame.bytes == ENGINE_CORE_DEAD:
                        resources.engine_dead = True
                        outputs_queue.put_nowait(
                            EngineDeadError(
                                "EngineCore hit a fatal error in a step and stopped; its "
                                "traceback is in the engine process's log above."
                            )
                        )
                        continue
                    outputs: EngineCoreOutputs = decoder.decode(frame)
                    if outputs.utility_output is not None:
                        uo = outputs.utility_output
                        future = utility_results.pop(uo.call_id)
                        if uo.failure_message is not None:
                            future.set_exception(Exception(uo.failure_message))
                        else:
                            future.set_result(uo.result)
                    else:
                        outputs_queue.put_nowait(outputs)
            except Exception as e:
                outputs_queue.put_nowait(e)
            finally:
                bound.set()
                shutdown_socket.close(linger=0)
                out_socket.close(linger=0)

        thread = threading.Thread(
            target=process_outputs_socket, name="EngineCoreOutputQueueThread", daemon=True
        )
        thread.start()
        bound.wait()
        resources.output_thread = thread

    # --8<-- [start:engine_core_monitor]
    def _start_engine_core_monitor(self) -> None:
        """Watch the process sentinel: a dead engine becomes EngineDeadError, not a hang."""
        resources, outputs_queue = self.resources, self.outputs_queue
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
            outputs_queue.put_nowait(EngineDeadError(reason))
            for future in list(utility_results.values()):
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
        self.ensure_alive()
        msg = (self.core_engine, request_type.value, self.encoder.encode(request))
        self.input_socket.send_multipart(msg, copy=False)

    @tracing.instrument("SyncMPClient.add_request")
    def add_request(self, request: EngineCoreRequest) -> None:
        """Send the request over ZeroMQ (its trace context rides in trace_headers)."""
        self._send_input(EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self.resources.engine_dead:
            self._send_input(EngineCoreRequestType.ABORT, request_ids)

    def call_utility(self, method: str, *args: Any) -> Any:
        call_id = uuid.uuid1().int >> 64
        future: Future[Any] = Future()
        self.utility_results[call_id] = future
        self._send_input(EngineCoreRequestType.UTILITY, (0, call_id, method, args))
        return future.result()

    def shutdown(self) -> None:
        self._finalizer()


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
