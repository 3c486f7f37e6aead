"""MessageQueue (shm_broadcast.py) between real processes.

Each scenario runs in its own Python process (a hang or a crash fails the
test, not pytest), which forks the readers and prints what it saw.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tracevllm.distributed.device_communicators.shm_broadcast import (
    SHM_NAME_PREFIX,
    MessageQueue,
)

# The scenarios' common start: a queue whose readers are forked children.
_PRELUDE = textwrap.dedent(
    """
    import json, multiprocessing, os, signal, sys, time
    from tracevllm.distributed.device_communicators.shm_broadcast import MessageQueue

    ctx = multiprocessing.get_context("fork")

    def say(**kw):
        print(json.dumps(kw), flush=True)
    """
)


def run_scenario(body: str, timeout: float = 60) -> list[dict]:
    code = _PRELUDE + textwrap.dedent(body)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def our_segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith(SHM_NAME_PREFIX)}


pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")


def test_messages_arrive_in_order_at_three_readers_with_a_large_one_by_the_fallback() -> None:
    """200 messages through a ring of 4 chunks (the writer waits for the
    slowest reader), one of them 64x a chunk (over the socket), in order."""
    before = our_segments()
    events = run_scenario(
        """
        N = 200
        def reader(handle, rank, out):
            mq = MessageQueue.create_from_handle(handle, rank)
            mq.wait_until_ready(timeout=30)
            got = [mq.dequeue(timeout=30) for _ in range(N)]
            ok = all(g["i"] == i for i, g in enumerate(got))
            big = [len(g["blob"]) for g in got if g["blob"]]
            out.send((ok, big))
            mq.close()

        mq = MessageQueue(3, 3, max_chunk_bytes=1024, max_chunks=4)
        pipes, procs = [], []
        for rank in range(3):
            r, w = ctx.Pipe(duplex=False)
            p = ctx.Process(target=reader, args=(mq.export_handle(), rank, w))
            p.start()
            pipes.append(r); procs.append(p)
        name = mq.buffer.name
        before_ready = os.path.exists("/dev/shm/" + name)
        mq.wait_until_ready(timeout=30)
        after_ready = os.path.exists("/dev/shm/" + name)
        for i in range(N):
            mq.enqueue({"i": i, "blob": b"x" * 65536 if i == 100 else b""}, timeout=30)
        results = [pipe.recv() for pipe in pipes]
        for p in procs:
            p.join(30)
        mq.close()
        say(results=results, before_ready=before_ready, after_ready=after_ready,
            codes=[p.exitcode for p in procs])
        """
    )
    (out,) = events
    assert out["results"] == [[True, [65536]]] * 3
    assert out["codes"] == [0, 0, 0]
    # The name exists until every reader has attached, then never again.
    assert out["before_ready"] and not out["after_ready"]
    assert our_segments() <= before


def test_a_dead_reader_is_a_timeout_for_the_writer() -> None:
    events = run_scenario(
        """
        def reader(handle):
            mq = MessageQueue.create_from_handle(handle, 0)
            mq.wait_until_ready(timeout=30)
            mq.dequeue(timeout=30)
            os.kill(os.getpid(), signal.SIGKILL)

        mq = MessageQueue(1, 1, max_chunk_bytes=256, max_chunks=2)
        p = ctx.Process(target=reader, args=(mq.export_handle(),))
        p.start()
        mq.wait_until_ready(timeout=30)
        for i in range(3):  # the reader reads one, then the ring is full
            mq.enqueue(i, timeout=10)
        p.join(10)
        start = time.monotonic()
        try:
            mq.enqueue(3, timeout=0.5)
            say(error=None)
        except TimeoutError:
            say(error="TimeoutError", waited=time.monotonic() - start, code=p.exitcode)
        """
    )
    assert events[0]["error"] == "TimeoutError"
    assert events[0]["code"] == -signal.SIGKILL
    assert 0.4 < events[0]["waited"] < 5


def test_a_dead_writer_is_a_timeout_for_the_readers_and_leaves_nothing() -> None:
    """The writer's process is SIGKILLed: its reader gets TimeoutError, and
    /dev/shm holds nothing once the reader is gone."""
    before = our_segments()
    events = run_scenario(
        """
        def writer(out):
            mq = MessageQueue(1, 1)
            out.send(mq.export_handle())
            mq.wait_until_ready(timeout=30)
            mq.enqueue("hello")
            time.sleep(60)

        r, w = ctx.Pipe(duplex=False)
        p = ctx.Process(target=writer, args=(w,))
        p.start()
        mq = MessageQueue.create_from_handle(r.recv(), 0)
        mq.wait_until_ready(timeout=30)
        first = mq.dequeue(timeout=30)
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        start = time.monotonic()
        try:
            mq.dequeue(timeout=0.5)
            say(first=first, error=None)
        except TimeoutError:
            say(first=first, error="TimeoutError", waited=time.monotonic() - start)
        mq.close()
        """
    )
    assert events[0]["first"] == "hello"
    assert events[0]["error"] == "TimeoutError"
    assert events[0]["waited"] < 5
    assert our_segments() <= before


def test_shutdown_wakes_a_reader_that_waits_forever() -> None:
    events = run_scenario(
        """
        import threading
        def writer(out):
            mq = MessageQueue(1, 1)
            out.send(mq.export_handle())
            mq.wait_until_ready(timeout=30)
            time.sleep(30)

        r, w = ctx.Pipe(duplex=False)
        p = ctx.Process(target=writer, args=(w,), daemon=True)
        p.start()
        mq = MessageQueue.create_from_handle(r.recv(), 0)
        mq.wait_until_ready(timeout=30)
        threading.Timer(0.3, mq.shutdown).start()
        start = time.monotonic()
        try:
            mq.dequeue(indefinite=True)
        except RuntimeError as e:
            say(error=str(e), waited=time.monotonic() - start)
        """
    )
    assert events[0]["error"] == "cancelled"
    assert events[0]["waited"] < 2


def test_a_writer_killed_before_the_readers_attach_leaves_no_segment() -> None:
    """Before the handshake the name must exist (readers attach by it): if
    the writer dies then, Python's resource tracker removes it."""
    before = our_segments()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _PRELUDE + "mq = MessageQueue(2, 2)\nsay(name=mq.buffer.name)\ntime.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    name = json.loads(proc.stdout.readline())["name"]
    assert name in our_segments()
    proc.kill()
    proc.wait(10)
    deadline = time.monotonic() + 10
    while name in our_segments() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert our_segments() <= before


def test_ctrl_c_stops_writer_and_readers_and_leaves_nothing() -> None:
    """SIGINT to the whole process group (a terminal's Ctrl-C) mid-stream."""
    before = our_segments()
    code = _PRELUDE + textwrap.dedent(
        """
        def reader(handle, rank):
            mq = MessageQueue.create_from_handle(handle, rank)
            mq.wait_until_ready(timeout=30)
            while True:
                mq.dequeue(indefinite=True)

        mq = MessageQueue(2, 2, max_chunks=2)
        procs = [ctx.Process(target=reader, args=(mq.export_handle(), r)) for r in range(2)]
        for p in procs:
            p.start()
        mq.wait_until_ready(timeout=30)
        say(pids=[p.pid for p in procs])
        try:
            while True:
                mq.enqueue(b"step", timeout=30)
                time.sleep(0.001)
        except KeyboardInterrupt:
            mq.close()
            for p in procs:
                p.join(10)
            say(codes=[p.exitcode for p in procs])
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert proc.stdout is not None
    pids = json.loads(proc.stdout.readline())["pids"]
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    codes = json.loads(out.splitlines()[-1])["codes"]
    assert all(code is not None for code in codes)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert our_segments() <= before


def test_only_local_readers() -> None:
    with pytest.raises(ValueError, match="local"):
        MessageQueue(2, 1)
