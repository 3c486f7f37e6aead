"""The benchmarks' two conditions: a quiet machine, and one busy core beside the engine.

tracevllm's own (no vLLM counterpart). Machines are shared: a laptop runs a
browser, a CI box other jobs. "One busy core" is one busy-loop process
(``python3 -c "while True: pass"``), started before a measured engine run
and stopped after it, so that every engine of a comparison (tracevllm, vLLM
eager and compiled, HF) meets the same load. "Quiet" is only as quiet as the
machine is: the 1-minute load average is read as each run starts and ends,
and saved beside its figure, with the share of CPU time the hypervisor stole
meanwhile (on a virtual machine another tenant's load shows only there).
Standard library only; shared by bench_throughput.py, bench_serve.py,
bench_threads.py, bench_compile.py and bench_tracing_cost.py (the CPU's name
is roofline.py's).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

BUSY_LOOP = "while True: pass"
CONDITIONS = ("quiet", "busy")
LABELS = {"quiet": "quiet", "busy": "one busy core"}
# How long the busy loop runs before the measured run starts: time to take its core.
SETTLE_S = 1.0


def parse_conditions(text: str) -> list[str]:
    """``--conditions``: ``quiet``, ``busy`` or both, comma-separated, in the order given."""
    names = [c.strip() for c in text.split(",") if c.strip()]
    if not names or not set(names) <= set(CONDITIONS) or len(set(names)) != len(names):
        raise ValueError(f"--conditions: quiet, busy or quiet,busy (got {text!r})")
    return names


def machine() -> dict[str, object]:
    """The CPU's model name, its core count and the load averages (1, 5, 15 min) now."""
    from roofline import machine as roofline_machine  # benchmarks/, standard library only

    cpu = roofline_machine()["cpu"]
    return {"cpu": cpu, "cores": os.cpu_count(), "load_average_at_start": list(os.getloadavg())}


def load_average() -> float:
    """The 1-minute load average."""
    return os.getloadavg()[0]


def procs_running() -> int:
    """Runnable tasks right now (``/proc/stat``'s ``procs_running``; 0 where unknown)."""
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("procs_running"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def cpu_jiffies(stat: str | None = None) -> tuple[int, int]:
    """(steal, total) time of all CPUs since boot, in clock ticks, from
    ``/proc/stat``'s ``cpu`` line (or ``stat``, its text); (0, 0) where unknown.
    Steal is time a virtual machine's CPU was ready to run and the hypervisor
    ran something else: another tenant's load, which neither the load average
    nor the run queue of this machine shows."""
    try:
        if stat is None:
            with open("/proc/stat") as f:
                stat = f.read()
        for line in stat.splitlines():
            fields = line.split()
            if fields and fields[0] == "cpu":
                ticks = [int(x) for x in fields[1:9]]  # user ... steal (guest is in user)
                return (ticks[7] if len(ticks) > 7 else 0), sum(ticks)
    except (OSError, ValueError):
        pass
    return 0, 0


def steal_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The share of the CPUs' time between two ``cpu_jiffies`` readings that the
    hypervisor took (nan where unknown)."""
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total > 0 else float("nan")


@dataclass
class Load:
    """One run's condition, the 1-minute load average as it started and ended,
    and the share of the CPUs' time stolen by the hypervisor meanwhile."""

    condition: str
    start: float = float("nan")
    end: float = float("nan")
    steal: float = float("nan")

    def __str__(self) -> str:
        return f"load {self.start:.2f}->{self.end:.2f}{fmt_steal(self.steal)}"


def fmt_steal(steal: float) -> str:
    """``, steal 12%`` where the hypervisor took at least half a percent, else ''."""
    return f", steal {steal:.0%}" if steal >= 0.005 else ""


def _busy_script(parent: int) -> str:
    """The busy loop, after two lines that tie it to ``parent``: Linux sends
    it SIGTERM when ``parent`` dies (``PR_SET_PDEATHSIG``), so that a benchmark
    killed mid-run leaves no core busy behind it; and it ends at once if
    ``parent`` is already gone. Set in the child itself: ``preexec_fn`` may
    deadlock in a parent with threads (torch's, the engine's)."""
    return (
        "import ctypes, os, signal\n"
        "ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG\n"
        f"if os.getppid() != {parent}: raise SystemExit\n"
        f"{BUSY_LOOP}\n"
    )


@contextmanager
def busy_core(busy: bool, settle_s: float = SETTLE_S) -> Iterator[None]:
    """One busy-loop process for the block's duration (nothing when not
    ``busy``); it ends with the block, or with this process if it is killed."""
    if not busy:
        yield
        return
    proc = subprocess.Popen([sys.executable, "-c", _busy_script(os.getpid())])
    try:
        time.sleep(settle_s)  # let it take its core
        yield
    finally:
        proc.terminate()
        proc.wait()


@contextmanager
def under(condition: str, settle_s: float = SETTLE_S) -> Iterator[Load]:
    """Run the block under ``condition`` ("quiet" or "busy"); the yielded
    ``Load`` gets the load average read after the busy loop has settled and
    again as the block ends (before the busy loop stops)."""
    if condition not in CONDITIONS:
        raise ValueError(f"unknown condition {condition!r}")
    load = Load(condition)
    with busy_core(condition == "busy", settle_s):
        load.start, jiffies = load_average(), cpu_jiffies()
        try:
            yield load
        finally:
            load.end, load.steal = load_average(), steal_share(jiffies, cpu_jiffies())


def run_under(
    conditions: Sequence[str],
    jobs: Sequence[tuple[str, Callable[[], T]]],
    settle_s: float = SETTLE_S,
) -> Iterator[tuple[str, str, T, Load]]:
    """Every ``(name, job)`` in turn under each condition, conditions outermost:
    yields (condition, name, job's result, its ``Load``). A busy loop lives
    exactly as long as one job (it is started before and stopped after each)."""
    for condition in conditions:
        for name, job in jobs:
            with under(condition, settle_s) as load:
                result = job()
            yield condition, name, result, load


class RunQueueSampler:
    """The machine's run queue sampled every ``interval`` s in a thread, while in the block.

    Sample from a process other than the measured engine's: the thread takes
    the GIL 50 times a second.
    """

    def __init__(self, interval: float = 0.02) -> None:
        self.interval = interval
        self.samples: list[int] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.wait(self.interval):
            self.samples.append(procs_running())

    def __enter__(self) -> RunQueueSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    @property
    def mean(self) -> float:
        return statistics.mean(self.samples) if self.samples else float("nan")
