"""One writer, N readers: a ring buffer of chunks in shared memory.

Mirrors vllm/distributed/device_communicators/shm_broadcast.py
(``ShmRingBuffer``, ``Handle``, ``MessageQueue``). The executor writes each
call (``execute_model`` and its ``SchedulerOutput``) once, and every rank's
worker reads it from the same memory: no copy per rank, no socket per
message. A message too big for a chunk goes over a ZeroMQ PUB socket instead,
with a flag in the chunk so it still arrives in order. Each worker answers on
its own one-reader queue.

Each chunk has a metadata row of 1 + N flag bytes: ``written``, then one
``read`` flag per reader. A chunk is writable when it is not written or all
readers have read it; readable by reader i when it is written and its flag
i is 0. The writer clears the read flags *before* setting ``written``, so a
reader never sees a half-reset row as "written and read by me".

Departures from vLLM:
- Readers wait on a notification socket (the writer pings after each write)
  instead of spinning on the flags for a second first: on a machine with
  fewer cores than ranks, spinning readers would starve the ranks that work.
- Every wait checks a timeout and a ``shutdown()`` flag: a dead peer gives
  ``TimeoutError`` (or ``RuntimeError("cancelled")``), never a hang.
- The segment's name is unlinked from /dev/shm as soon as every reader has
  attached (``wait_until_ready``): the memory lives on while anyone maps it,
  and nothing is left behind whoever dies, however. The ZeroMQ addresses
  leave no file either (utils/network_utils.py).
- No remote (other-node) readers, no out-of-band pickle buffers.
"""

from __future__ import annotations

import contextlib
import pickle
import threading
import time
import uuid
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import zmq

from tracevllm.logger import init_logger
from tracevllm.utils.network_utils import get_open_zmq_ipc_path

logger = init_logger(__name__)

# Segment names start with this (so a test can look for leftovers in /dev/shm).
SHM_NAME_PREFIX = "tracevllm_mq_"
# A reader that waits this long logs that it is still waiting (vLLM's
# VLLM_RINGBUFFER_WARNING_INTERVAL).
RINGBUFFER_WARNING_INTERVAL_S = 60.0
# Longest single sleep while waiting: how soon a wait notices a timeout.
_POLL_SLICE_S = 1.0
_HEADER = 5  # overflow flag (1 byte) + payload length (4 bytes, big-endian)

_fence_lock = threading.Lock()


def memory_fence() -> None:
    """Order the flag writes around the data writes, for other processes too
    (vLLM's: a lock's acquire and release are full barriers)."""
    with _fence_lock:
        pass


class ShmRingBuffer:
    """``max_chunks`` chunks of ``max_chunk_bytes``, then their metadata rows."""

    def __init__(
        self, n_reader: int, max_chunk_bytes: int, max_chunks: int, name: str | None = None
    ) -> None:
        self.n_reader = n_reader
        self.metadata_size = 1 + n_reader
        self.max_chunk_bytes = max_chunk_bytes
        self.max_chunks = max_chunks
        self.metadata_offset = max_chunk_bytes * max_chunks
        total = (max_chunk_bytes + self.metadata_size) * max_chunks
        self.is_creator = name is None
        if name is None:
            name = SHM_NAME_PREFIX + uuid.uuid4().hex[:16]
            self.shared_memory = shared_memory.SharedMemory(name=name, create=True, size=total)
            self._finalizer = weakref.finalize(self, _unlink_quietly, name)
        else:
            # Python < 3.13 registers an opened segment with the resource
            # tracker as if this process owned it (vLLM patches it out too).
            register = resource_tracker.register
            resource_tracker.register = lambda *args, **kwargs: None  # type: ignore[assignment]
            try:
                self.shared_memory = shared_memory.SharedMemory(name=name)
            finally:
                resource_tracker.register = register  # type: ignore[assignment]
        self.name = name
        self.unlinked = not self.is_creator
        self.buf: memoryview = self.shared_memory.buf  # type: ignore[assignment]
        if self.is_creator:
            self.buf[self.metadata_offset : total] = bytes(total - self.metadata_offset)

    def handle(self) -> tuple[int, int, int, str]:
        return (self.n_reader, self.max_chunk_bytes, self.max_chunks, self.name)

    def get_data(self, idx: int) -> memoryview:
        start = idx * self.max_chunk_bytes
        return self.buf[start : start + self.max_chunk_bytes]

    def get_metadata(self, idx: int) -> memoryview:
        start = self.metadata_offset + idx * self.metadata_size
        return self.buf[start : start + self.metadata_size]

    def unlink(self) -> None:
        """Remove the name (the creator, once); the mapping stays valid."""
        if not self.unlinked:
            self.unlinked = True
            self._finalizer.detach()
            with contextlib.suppress(FileNotFoundError):
                self.shared_memory.unlink()

    def close(self) -> None:
        self.unlink()
        self.buf.release()
        self.shared_memory.close()


def _unlink_quietly(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        shm = shared_memory.SharedMemory(name=name)
        shm.close()
        shm.unlink()


@dataclass
class Handle:
    """What a reader needs to attach: pickled to the worker processes."""

    local_reader_ranks: list[int] = field(default_factory=list)
    buffer_handle: tuple[int, int, int, str] | None = None
    local_subscribe_addr: str | None = None
    local_notify_addr: str | None = None


class MessageQueue:
    """Broadcast from one writer to ``n_reader`` readers on this machine."""

    # A reader's only: shutdown() wakes its waits through this pair.
    _cancel_reader: zmq.Socket[bytes]
    _cancel_writer: zmq.Socket[bytes]
    _poller: zmq.Poller

    # --8<-- [start:message_queue_init]
    def __init__(
        self,
        n_reader: int,
        n_local_reader: int,
        local_reader_ranks: list[int] | None = None,
        max_chunk_bytes: int = 4 * 1024 * 1024,
        max_chunks: int = 10,
    ) -> None:
        if n_local_reader != n_reader:
            raise ValueError("tracevllm's MessageQueue has local (same-machine) readers only.")
        if local_reader_ranks is None:
            local_reader_ranks = list(range(n_local_reader))
        self.n_local_reader = n_local_reader
        self.buffer = ShmRingBuffer(n_local_reader, max_chunk_bytes, max_chunks)
        self.context = zmq.Context()
        # XPUB, not PUB: it receives each reader's subscription, so the writer
        # knows when all are connected (wait_until_ready).
        self.local_socket = self._xpub(get_open_zmq_ipc_path())
        self.notify_socket = self._xpub(get_open_zmq_ipc_path())
        self.current_idx = 0
        self._is_writer = True
        self.local_reader_rank = -1
        self.shutting_down = False
        self._lock = threading.Lock()
        self.handle = Handle(
            local_reader_ranks=local_reader_ranks,
            buffer_handle=self.buffer.handle(),
            local_subscribe_addr=self.local_socket.getsockopt_string(zmq.LAST_ENDPOINT),
            local_notify_addr=self.notify_socket.getsockopt_string(zmq.LAST_ENDPOINT),
        )

    # --8<-- [end:message_queue_init]

    def _xpub(self, address: str) -> zmq.Socket[bytes]:
        socket: zmq.Socket[bytes] = self.context.socket(zmq.XPUB)
        socket.setsockopt(zmq.XPUB_VERBOSE, True)
        socket.setsockopt(zmq.LINGER, 0)
        socket.bind(address)
        return socket

    def export_handle(self) -> Handle:
        return self.handle

    @staticmethod
    def create_from_handle(handle: Handle, rank: int) -> MessageQueue:
        """The reader side, in another process: attach the memory, then subscribe."""
        self = MessageQueue.__new__(MessageQueue)
        assert handle.buffer_handle is not None and rank in handle.local_reader_ranks
        self.handle = handle
        self._is_writer = False
        self.local_reader_rank = handle.local_reader_ranks.index(rank)
        self.n_local_reader = len(handle.local_reader_ranks)
        self.buffer = ShmRingBuffer(*handle.buffer_handle)
        self.current_idx = 0
        self.shutting_down = False
        self._lock = threading.Lock()
        self.context = zmq.Context()
        self.local_socket = self._sub(handle.local_subscribe_addr)
        # Only the latest ping matters: it says "look at the flags again".
        self.notify_socket = self._sub(handle.local_notify_addr, conflate=True)
        # shutdown() from another thread wakes a waiting read through this pair.
        cancel_addr = f"inproc://tracevllm-mq-cancel-{uuid.uuid4().hex}"
        self._cancel_reader = self.context.socket(zmq.PAIR)
        self._cancel_reader.bind(cancel_addr)
        self._cancel_writer = self.context.socket(zmq.PAIR)
        self._cancel_writer.connect(cancel_addr)
        self._poller = zmq.Poller()
        self._poller.register(self.notify_socket, zmq.POLLIN)
        self._poller.register(self._cancel_reader, zmq.POLLIN)
        return self

    def _sub(self, address: str | None, conflate: bool = False) -> zmq.Socket[bytes]:
        assert address is not None
        socket: zmq.Socket[bytes] = self.context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        if conflate:
            socket.setsockopt(zmq.CONFLATE, 1)
        socket.setsockopt_string(zmq.SUBSCRIBE, "")
        socket.connect(address)
        return socket

    # --- handshake ------------------------------------------------------------
    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Collective: the writer and every reader call it once, before any message.

        The writer waits for every reader's subscription on both sockets,
        then sends READY; from then on no reader needs the segment's name,
        so it is unlinked.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._is_writer:
            for socket in (self.local_socket, self.notify_socket):
                for _ in range(self.n_local_reader):
                    self._recv_wait(socket, deadline)
            self.local_socket.send(b"READY")
            self.buffer.unlink()
        else:
            recv = self._recv_wait(self.local_socket, deadline)
            assert recv == b"READY", recv

    def _recv_wait(self, socket: zmq.Socket[bytes], deadline: float | None) -> bytes:
        """One message from ``socket``, in slices that notice shutdown and the deadline."""
        while not socket.poll(self._slice_ms(deadline)):
            pass
        return socket.recv()

    def _slice_ms(self, deadline: float | None) -> int:
        """How long the next wait may sleep (ms); raises when it must stop."""
        if self.shutting_down:
            raise RuntimeError("cancelled")
        left = _POLL_SLICE_S if deadline is None else deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        return max(1, int(min(left, _POLL_SLICE_S) * 1000))

    # --- writing --------------------------------------------------------------
    @contextlib.contextmanager
    def acquire_write(self, timeout: float | None = None) -> Iterator[memoryview]:
        """The next chunk, once every reader has read what it held."""
        assert self._is_writer, "Only writers can acquire write"
        deadline = None if timeout is None else time.monotonic() + timeout
        buffer, idx = self.buffer, self.current_idx
        with buffer.get_metadata(idx) as metadata:
            sleep = 0.0
            while True:
                memory_fence()
                if not metadata[0] or sum(metadata[1:]) == buffer.n_reader:
                    break
                # A reader is behind by max_chunks messages: back off, up to 1 ms.
                self._slice_ms(deadline)
                time.sleep(sleep)
                sleep = min(2 * sleep + 1e-5, 1e-3)
            metadata[0] = 0
            with buffer.get_data(idx) as data:
                yield data
            for i in range(1, buffer.n_reader + 1):
                metadata[i] = 0
            memory_fence()
            metadata[0] = 1
            memory_fence()
        self.current_idx = (idx + 1) % buffer.max_chunks

    def enqueue(self, obj: Any, timeout: float | None = None) -> None:
        """Pickle ``obj`` into the next chunk, or over the socket if it is too big."""
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        if _HEADER + len(payload) > self.buffer.max_chunk_bytes:
            with self.acquire_write(timeout) as chunk:
                chunk[0] = 1  # overflow: the payload follows on the socket
            self.local_socket.send(payload, copy=False)
        else:
            with self.acquire_write(timeout) as chunk:
                chunk[0] = 0
                chunk[1:_HEADER] = len(payload).to_bytes(4, "big")
                chunk[_HEADER : _HEADER + len(payload)] = payload
        self.notify_socket.send(b"\x00")

    # --- reading --------------------------------------------------------------
    @contextlib.contextmanager
    def acquire_read(
        self, timeout: float | None = None, indefinite: bool = False
    ) -> Iterator[memoryview]:
        """The next chunk, once the writer has written it; sleeps on the pings."""
        assert not self._is_writer, "Only readers can acquire read"
        deadline = None if timeout is None else time.monotonic() + timeout
        next_warning = time.monotonic() + RINGBUFFER_WARNING_INTERVAL_S
        buffer, idx, flag = self.buffer, self.current_idx, self.local_reader_rank + 1
        with buffer.get_metadata(idx) as metadata:
            while True:
                memory_fence()
                if metadata[0] and not metadata[flag]:
                    break
                events = dict(self._poller.poll(self._slice_ms(deadline)))
                if self.notify_socket in events:
                    self.notify_socket.recv()
                if not indefinite and time.monotonic() > next_warning:
                    logger.info(
                        "No message from the writer in %d seconds.", RINGBUFFER_WARNING_INTERVAL_S
                    )
                    next_warning += RINGBUFFER_WARNING_INTERVAL_S
            with buffer.get_data(idx) as data:
                yield data
            metadata[flag] = 1
            memory_fence()
        self.current_idx = (idx + 1) % buffer.max_chunks

    def dequeue(self, timeout: float | None = None, indefinite: bool = False) -> Any:
        """The next message; ``TimeoutError`` after ``timeout`` seconds, or
        ``RuntimeError("cancelled")`` once ``shutdown()`` was called."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.acquire_read(timeout, indefinite) as chunk:
            overflow = chunk[0] == 1
            if not overflow:
                size = int.from_bytes(chunk[1:_HEADER], "big")
                obj = pickle.loads(chunk[_HEADER : _HEADER + size])
        if overflow:
            obj = pickle.loads(self._recv_wait(self.local_socket, deadline))
        return obj

    # --- the end --------------------------------------------------------------
    def shutdown(self) -> None:
        """Wake and stop whoever waits on this queue (thread-safe; idempotent)."""
        with self._lock:
            if self.shutting_down:
                return
            self.shutting_down = True
            if self._is_writer:
                self.buffer.unlink()
            else:
                self._cancel_writer.send(b"\x00")

    def close(self) -> None:
        """Release the memory and the sockets (from the thread that uses them;
        idempotent)."""
        self.shutdown()
        if not self.context.closed:
            self.context.destroy(linger=0)
            self.buffer.close()
