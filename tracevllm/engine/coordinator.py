"""DPCoordinator: the process between D data-parallel engine cores and the frontend.

Mirrors vllm/v1/engine/coordinator.py. ``DPCoordinator`` starts the process
(``DPCoordinatorProc.run_coordinator``), which:

* collects each engine's queue lengths (``SchedulerStats`` with
  ``num_waiting_reqs`` / ``num_running_reqs``, sent by ``DPEngineCoreProc``
  whenever they change) and publishes them to the frontend, which sends each
  new request to the least-loaded engine (``DPLBAsyncMPClient``);
* keeps the request wave: the number of times the engines, together, went
  from running to idle. A frontend that sends a request while the engines are
  idle says so (``FIRST_REQ``), and the coordinator broadcasts
  ``START_DP_WAVE`` to the other engines; an engine that gets a request of an
  older wave while idle asks for the next wave (``start_wave``).

Departure: vLLM only runs ``DPEngineCoreProc`` (and so waves) for MoE models,
whose engines must step together because their expert layers all-reduce
across DP ranks; rank 0 then reports the end of a wave after an all-reduce
over the DP group. tracevllm's models are dense, so there is no collective
between engines and an engine with nothing to do never waits for (or runs
dummy batches for) the others: each engine reports ``wave_complete`` when it
goes idle, and the coordinator ends the wave when every engine has. The
coordinator's sockets live in the frontend's socket directory (vLLM picks its
own ``ipc://`` paths), and the process exits when its parent dies.

Sockets (as vLLM's): ``publish_front`` (XPUB, bound; the frontend subscribes
with an XSUB and sends ``FIRST_REQ`` back up it), ``output_back`` (PULL,
bound; every engine PUSHes its stats there) and ``publish_back`` (XPUB,
bound; engines subscribe, get READY once all have, then START_DP_WAVE).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import time
import uuid
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import zmq

from tracevllm import tracing
from tracevllm.config import ParallelConfig
from tracevllm.engine import EngineCoreOutputs, EngineCoreRequestType
from tracevllm.logger import init_logger
from tracevllm.serial_utils import MsgpackDecoder

logger = init_logger(__name__)

# How long the coordinator waits for every engine to subscribe (seconds).
SUBSCRIBE_TIMEOUT_S = 600.0


class DPCoordinator:
    """Starts the coordinator process and knows its three addresses."""

    def __init__(
        self,
        parallel_config: ParallelConfig,
        socket_dir: str,
        mp_context: Any = None,
        min_stats_update_interval_ms: int = 100,
    ) -> None:
        dp_size = parallel_config.data_parallel_size
        assert dp_size > 1, "Coordinator only used for data parallel"
        ctx = mp_context or multiprocessing.get_context()

        def address(name: str) -> str:
            return f"ipc://{socket_dir}/{name}-{uuid.uuid4().hex[:8]}"

        self.stats_publish_address = address("dp-front-publish")
        self.coord_in_address = address("dp-back-publish")
        self.coord_out_address = address("dp-back-output")
        ready_r, ready_w = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(
            target=DPCoordinatorProc.run_coordinator,
            name="DPCoordinator",
            kwargs=dict(
                engine_count=dp_size,
                front_publish_address=self.stats_publish_address,
                back_output_address=self.coord_out_address,
                back_publish_address=self.coord_in_address,
                ready_pipe=ready_w,
                min_stats_update_interval_ms=min_stats_update_interval_ms,
            ),
            daemon=True,
        )
        self.proc.start()
        ready_w.close()
        try:
            # Bound before any engine or frontend connects (ipc:// needs the file).
            if not multiprocessing.connection.wait([ready_r, self.proc.sentinel], timeout=60):
                raise RuntimeError("DP Coordinator process failed to bind its sockets in time.")
            try:
                ready_r.recv()
            except EOFError:
                raise RuntimeError("DP Coordinator process failed during startup.") from None
        except BaseException:
            self.proc.kill()
            self.proc.join(5)
            raise
        finally:
            ready_r.close()

    def get_stats_publish_address(self) -> str:
        return self.stats_publish_address

    def get_engine_socket_addresses(self) -> tuple[str, str]:
        """The engines' (input, output) addresses: START_DP_WAVE comes in on
        the first, their stats go out on the second."""
        return self.coord_in_address, self.coord_out_address


class EngineState:
    def __init__(self) -> None:
        self.request_counts = [0, 0]  # [waiting, running]
        # The wave this engine last said it finished (-1: none yet).
        self.wave_complete = -1


class DPCoordinatorProc:
    def __init__(self, engine_count: int, min_stats_update_interval_ms: int = 100) -> None:
        self.ctx = zmq.Context()
        self.engines = [EngineState() for _ in range(engine_count)]
        self.stats_update_interval_ms = min_stats_update_interval_ms
        # The request wave and whether the engines are in it (running).
        self.current_wave = 0
        self.engines_running = False

    @staticmethod
    def run_coordinator(
        engine_count: int,
        front_publish_address: str,
        back_output_address: str,
        back_publish_address: str,
        ready_pipe: Connection | None = None,
        min_stats_update_interval_ms: int = 100,
    ) -> None:
        # SIGTERM (the frontend's shutdown) and Ctrl-C end the loop quietly.
        def signal_handler(signum: int, frame: Any) -> None:
            raise SystemExit()

        signal.signal(signal.SIGTERM, signal_handler)
        signal.signal(signal.SIGINT, signal_handler)
        # The frontend's tracer, if inherited by fork, is not this process's.
        tracing.shutdown_tracer()
        coordinator = DPCoordinatorProc(engine_count, min_stats_update_interval_ms)
        try:
            coordinator.process_input_socket(
                front_publish_address, back_output_address, back_publish_address, ready_pipe
            )
        except SystemExit:
            logger.debug("DP Coordinator process exiting")
        finally:
            if ready_pipe is not None:
                ready_pipe.close()
            coordinator.ctx.destroy(linger=0)

    def _bind(self, socket_type: int, address: str) -> zmq.Socket:
        socket = self.ctx.socket(socket_type)
        socket.setsockopt(zmq.LINGER, 0)
        socket.bind(address)
        return socket

    def process_input_socket(
        self,
        front_publish_address: str,
        back_output_address: str,
        back_publish_address: str,
        ready_pipe: Connection | None = None,
    ) -> None:
        decoder = MsgpackDecoder(EngineCoreOutputs)
        parent = multiprocessing.parent_process()
        publish_front = self._bind(zmq.XPUB, front_publish_address)
        output_back = self._bind(zmq.PULL, back_output_address)
        publish_back = self._bind(zmq.XPUB, back_publish_address)
        # Every engine's subscription counts, not only the first of a topic.
        publish_back.setsockopt(zmq.XPUB_VERBOSE, 1)
        if ready_pipe is not None:
            ready_pipe.send(True)
            ready_pipe.close()

        poller = zmq.Poller()
        poller.register(publish_front, zmq.POLLIN)
        poller.register(publish_back, zmq.POLLIN)
        poller.register(output_back, zmq.POLLIN)
        if parent is not None:
            # A frontend killed with SIGKILL must not leave this process behind.
            poller.register(parent.sentinel, zmq.POLLIN)

        # Wait until all engines subscribe, then tell them all at once.
        subscribed = 0
        deadline = time.monotonic() + SUBSCRIBE_TIMEOUT_S
        while subscribed < len(self.engines):
            events = dict(poller.poll(timeout=1000))
            if parent is not None and parent.sentinel in events:
                return
            if time.monotonic() > deadline:
                logger.error("DP Coordinator: the engines did not all subscribe in time.")
                return
            if publish_back in events and publish_back.recv() == b"\x01":
                subscribed += 1
            if publish_front in events:
                publish_front.recv()  # the frontend's subscription
        publish_back.send(b"READY")
        logger.info("All engine subscriptions received by DP coordinator")

        stats_changed = False
        last_publish_time = 0.0
        while True:
            elapsed_ms = (time.monotonic() - last_publish_time) * 1000
            # Publish at most every stats_update_interval_ms when the counts
            # changed, else every 5 s (a frontend that subscribed late catches up).
            wait_for = self.stats_update_interval_ms if stats_changed else 5000
            if elapsed_ms >= wait_for:
                # Due even while messages keep coming (vLLM publishes only when
                # the poll times out, which a busy engine's stream can put off).
                counts = self._get_engine_counts()
                publish_front.send(
                    msgspec.msgpack.encode((counts, self.current_wave, self.engines_running))
                )
                last_publish_time = time.monotonic()
                stats_changed = False
                continue
            events = dict(poller.poll(timeout=max(0, int(wait_for - elapsed_ms))))
            if parent is not None and parent.sentinel in events:
                return
            if not events:
                continue

            wave_state_changed = False
            # An engine (re)subscribing: answer READY again (0: it unsubscribed).
            if publish_back in events and publish_back.recv() == b"\x01":
                publish_back.send(b"READY")

            if publish_front in events:
                buffer = publish_front.recv()
                if buffer not in (b"\x01", b"\x00"):  # not a (un)subscription
                    # A frontend sent a request while the engines were idle:
                    # wake the other engines into the current wave.
                    engine_to_exclude, wave = msgspec.msgpack.decode(buffer)
                    if not self.engines_running:
                        if wave < self.current_wave:
                            # A stale wave: every engine must hear of the new one.
                            engine_to_exclude = None
                        self._start_wave(publish_back, self.current_wave, engine_to_exclude)
                        wave_state_changed = True

            while output_back in events:
                outputs: EngineCoreOutputs = decoder.decode(output_back.recv())
                stats_changed |= self._process_engine_message(outputs, publish_back)
                wave_state_changed |= outputs.wave_complete is not None or (
                    outputs.start_wave is not None
                )
                events = dict(poller.poll(timeout=0))  # drain what is there

            if wave_state_changed:
                message = (None, self.current_wave, self.engines_running)
                publish_front.send(msgspec.msgpack.encode(message))

    def _process_engine_message(self, outputs: EngineCoreOutputs, publish_back: Any) -> bool:
        """Apply one engine's message; returns whether its counts changed."""
        assert not outputs.outputs and outputs.utility_output is None
        engine = self.engines[outputs.engine_index]
        changed = False
        if (stats := outputs.scheduler_stats) is not None:
            engine.request_counts = [stats.num_waiting_reqs, stats.num_running_reqs]
            changed = True
        if (wave := outputs.wave_complete) is not None:
            engine.wave_complete = max(engine.wave_complete, wave)
            # The wave ends when every engine has finished it (vLLM: rank 0
            # says so after an all-reduce; here no engine waits for another).
            if self.engines_running and all(
                e.wave_complete >= self.current_wave for e in self.engines
            ):
                logger.debug("Moving DP wave from %d to %d.", self.current_wave, wave + 1)
                self.current_wave += 1
                self.engines_running = False
        elif (wave := outputs.start_wave) is not None and (
            wave > self.current_wave or (wave == self.current_wave and not self.engines_running)
        ):
            # An engine got a request of an older wave while idle: the others
            # must move to its wave too.
            logger.debug("Starting wave %d after notification of stale wave request.", wave)
            self._start_wave(publish_back, wave, outputs.engine_index)
        return changed

    def _start_wave(self, socket: Any, wave: int, exclude_engine_index: int | None) -> None:
        """Broadcast START_DP_WAVE (the wave, and the engine that already has
        a request of it and needs no telling)."""
        self.current_wave = wave
        self.engines_running = True
        for index, engine in enumerate(self.engines):
            # An engine told of the wave has not finished it until it says so
            # (being idle, it will at once). The excluded one got a request
            # of this wave and reports when done: possibly already, if it
            # was quicker than this message.
            if index != exclude_engine_index:
                engine.wave_complete = min(engine.wave_complete, wave - 1)
        encoded = msgspec.msgpack.encode((wave, exclude_engine_index))
        socket.send_multipart((EngineCoreRequestType.START_DP_WAVE.value, encoded))

    def _get_engine_counts(self) -> list[list[int]]:
        """[waiting, running] of each engine."""
        return [list(e.request_counts) for e in self.engines]


def remove_socket_files(*addresses: str) -> None:
    """Remove ``ipc://`` socket files (the frontend removes their directory too)."""
    for address in addresses:
        if address.startswith("ipc://"):
            with contextlib.suppress(OSError):
                os.unlink(address[len("ipc://") :])
