"""The threads xgrammar runs a user's constraint on: a large stack, started once.

tracevllm's own (vLLM 0.22.0 compiles on a plain ``ThreadPoolExecutor`` and
parses at the entry on the caller's thread). xgrammar parses and compiles in
C++, recursing once per nesting level and per ``$ref`` it follows; on an
8 MiB stack (Linux's default) a chain of 16000 ``$ref``s is a segfault that
kills the process that parses (limits.py has the measurements). So every
parse and compilation of a user's constraint runs on a thread with a
``GRAMMAR_THREAD_STACK_BYTES`` (256 MiB) stack: address space, not memory,
as pages are only touched when used. The worst that limits.py's checks
allow fits in 8 MiB; 256 MiB is 32 times that, for what the measurements
did not try.

``threading.stack_size`` is process-wide: every thread started while it is
set gets that stack, whoever starts it. So a ``LargeStackExecutor`` sets it
once, under a lock, starts all its threads and puts the size back at once;
the work then goes to those threads through a queue. The engine's grammar
pool is one (``StructuredOutputManager``); ``run_with_large_stack`` hands
the entry's parses to one shared worker, made with the first, and runs
``fn`` in place when called on a large-stack thread already (the pool's
compilations). Where the system refuses that much address space (strict
overcommit), the threads get the default stack: the limits alone keep
xgrammar within 8 MiB.
"""

from __future__ import annotations

import os
import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from tracevllm.logger import init_logger

logger = init_logger(__name__)

T = TypeVar("T")

GRAMMAR_THREAD_STACK_BYTES = 256 * 1024 * 1024

_WorkItem = tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]

# Held while threading.stack_size is not the process's own.
_stack_size_lock = threading.Lock()
# Set on the executors' threads: run_with_large_stack runs in place there.
_on_large_stack = threading.local()


class LargeStackExecutor:
    """``max_workers`` threads with a ``GRAMMAR_THREAD_STACK_BYTES`` stack,
    started at once and fed in order; ``submit`` and ``shutdown`` as
    ``concurrent.futures.ThreadPoolExecutor``'s (its futures, so ``wait``
    works on them). The threads are daemons: a compilation under way does
    not hold the process at exit."""

    def __init__(self, max_workers: int, thread_name_prefix: str) -> None:
        self._queue: queue.SimpleQueue[_WorkItem | None] = queue.SimpleQueue()
        self._pid = os.getpid()
        self._shutdown = False
        # The threads hold the queue, not the executor: once it is dropped
        # unshut, the finalizer stops them.
        self._threads = [
            threading.Thread(
                target=_work, args=(self._queue,), name=f"{thread_name_prefix}_{i}", daemon=True
            )
            for i in range(max_workers)
        ]
        weakref.finalize(self, _stop, self._queue, max_workers)
        with _stack_size_lock:
            previous = threading.stack_size(GRAMMAR_THREAD_STACK_BYTES)
            try:
                for thread in self._threads:
                    try:
                        thread.start()
                    except RuntimeError:  # no address space for that stack
                        threading.stack_size(previous)
                        logger.warning(
                            "no thread with a %d-byte stack; xgrammar runs on default ones",
                            GRAMMAR_THREAD_STACK_BYTES,
                        )
                        thread.start()
            finally:
                threading.stack_size(previous)

    def submit(self, fn: Callable[..., T], /, *args: Any) -> Future[T]:
        if self._shutdown:
            raise RuntimeError("cannot schedule new futures after shutdown")
        if os.getpid() != self._pid:  # its threads stayed in the parent
            raise RuntimeError("this executor was made in another process (before a fork)")
        future: Future[T] = Future()
        self._queue.put((future, fn, args))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No more work; with ``cancel_futures`` what has not started is
        cancelled; with ``wait``, returns once the threads have ended."""
        self._shutdown = True
        if cancel_futures:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
        _stop(self._queue, len(self._threads))
        if wait:
            for thread in self._threads:
                thread.join()


def _work(work: queue.SimpleQueue[_WorkItem | None]) -> None:
    """A thread's loop: each item's outcome on its future, whatever it
    raises, until a ``None``."""
    _on_large_stack.active = True
    while (item := work.get()) is not None:
        future, fn, args = item
        del item  # hold no result past its future
        if future.set_running_or_notify_cancel():
            try:
                result = fn(*args)
            except BaseException as e:  # handed to whoever waits on the future
                future.set_exception(e)
            else:
                future.set_result(result)
        del future, fn, args


def _stop(work: queue.SimpleQueue[_WorkItem | None], num_threads: int) -> None:
    for _ in range(num_threads):
        work.put(None)


_shared: LargeStackExecutor | None = None
_shared_lock = threading.Lock()


def _forget_after_fork() -> None:
    """A forked child has none of its parent's threads: its first parse
    makes a worker of its own (and a lock held mid-fork is not held here)."""
    global _shared, _shared_lock, _stack_size_lock
    _shared = None
    _shared_lock = threading.Lock()
    _stack_size_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


def run_with_large_stack(fn: Callable[[], T]) -> T:
    """``fn()`` on a thread with a ``GRAMMAR_THREAD_STACK_BYTES`` stack: in
    place on one already, else on the shared worker (calls from several
    threads take turns; a parse is bounded by limits.py). What ``fn``
    raises is raised here."""
    global _shared
    if getattr(_on_large_stack, "active", False):
        return fn()
    with _shared_lock:
        if _shared is None:
            _shared = LargeStackExecutor(1, thread_name_prefix="xgrammar")
        executor = _shared
    return executor.submit(fn).result()
