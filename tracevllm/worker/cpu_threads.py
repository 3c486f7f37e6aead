"""The engine's torch thread count on a shared CPU, adapted while it runs.

tracevllm's own: vLLM's CPU worker fixes its OpenMP threads once at start
(vllm/utils/ompmultiprocessing.py, one CPU left to the frontend), and so does
tracevllm when ``TRACEVLLM_NUM_THREADS`` or
``TRACEVLLM_CPU_NUM_OF_RESERVED_CPU`` is set. Otherwise, with one rank on the
machine, ``AdaptiveThreadPolicy`` picks the count between steps
(``TRACEVLLM_CPU_ADAPTIVE_THREADS=0`` turns it off).

Why: an OpenMP parallel region ends at a barrier, so it lasts as long as its
slowest thread. With every core given to OpenMP and one other busy process on
the machine, the kernel deschedules one of the engine's threads for a time
slice at a time and every region waits for it: on a 2-core machine make
bench's workload fell from 169 to 52 tok/s, where one thread did 116 quiet
and 128 beside the busy process. No fixed count wins both.

How: the first probe runs before the first request, on dummy forward
passes of one shape (``probe_at_warm_up``, from the worker's warm-up);
after that, now and then, the policy runs a *probe* between real steps: it
alternates steps between the current count and one neighbour (one fewer;
one more when already below the maximum), pairs each step at one count
with the step next to it at the other, and keeps a pair only when both
steps have the same shape (requests and scheduled tokens: in a
decode-heavy run most neighbouring steps do). The
median of the pairs' time ratios decides: the neighbour is taken only when
it is faster by more than the hysteresis plus two standard errors of the
steps' own noise (measured on neighbouring steps of one shape at one count,
and on the pairs' scatter), so that on a busy machine, where step times
vary by tens of percent, the count does not flap. Beside a busy core,
though, the steps at the count that stalls vary twofold from one to the
next, and that allowance outgrew a twofold gain (five pairs, 2 vs 1: 0.45
0.45 0.88 0.78 0.77, kept two threads at 110 tok/s where one ran 210). So a
median beyond the hysteresis also wins when the pairs favour the neighbour
more often than chance would (a sign test: five of five, 1 in 32 were the
counts equally fast; at most about 6% over a probe's three looks), which a
twofold stall cannot inflate; and one that
passes neither test gets more pairs, looked at again after each ``pairs``
(up to ``3 * pairs`` pairs in all), as the allowance shrinks with the
square root of their number. A probe stops at its
first pair when the neighbour is more than 1.25x slower (so a bad
neighbour costs one step), and after three pairs when it is more than
1.25x faster all three times. For that first test only, and only while a
probe has no like pair, a pair of two decode steps whose batches differ by
at most an eighth stands in (``near_ratio``, which errs toward a tie): as
requests finish, a
run's last steps seldom repeat a shape, and a probe there went on through
its ``pairs`` unlike pairs, every one a step at the slower count
(``python benchmarks/sim_probe_cost.py``, the policy on make bench's step
shapes with made-up times: the probes cost 1.2% of the run quiet and 2.3%
beside a busy core, 0.35% and 0.8% with these pairs). Such
a pair can only stop a probe, never make a switch or keep a like pair
from stopping one: its ratio is an estimate (up to a tenth off for batches
of 7 and 8), which the 1.25x margin covers and a median decided within the
hysteresis would not. A probe that finds no like-shaped pairs
(arrivals in serving, chunked prefills beside decodes) ends after
``pairs`` unlike pairs. No probe runs more than ``3 * pairs`` steps at the
other count.
After a probe that kept the count the next one comes twice as late, or
later still when the probe's slow steps cost more than 3% of the steps
until the next one (up to ``max_interval`` steps); after a change, after
``2 * min_interval`` steps, which follows a load that keeps changing
without undoing at once a switch that noise made.

Why step times rather than the run queue (``/proc/loadavg``'s running
count, ``/proc/stat``'s ``procs_running``): those count the engine's own
OpenMP threads too, which spin a while between regions, and a runnable
neighbour says nothing about whether one thread fewer is faster for this
model and batch; the step times measure exactly the trade that decides, at
the cost of the probe's steps. ``make bench-threads`` prints the run queue
beside each run's throughput for comparison.

The count applies to eager kernels, oneDNN's matmuls and compiled code
alike: all three ask OpenMP for the thread count when a region starts
(Inductor's C++ is generated with ``cpp.dynamic_threads``, a bare
``#pragma omp parallel``, see platforms/cpu.py), and ``torch.set_num_threads``
sets that count for the calling thread, the one that runs the steps. A
matmul splits its sums by thread count, so when the count changes depends on
timing, and so do a run's last bits (on a near-tie, a greedy token): set
``TRACEVLLM_NUM_THREADS`` where runs must repeat bit for bit.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import torch

from tracevllm import tracing
from tracevllm.logger import init_logger

if TYPE_CHECKING:
    from tracevllm.core.sched.output import SchedulerOutput

T = TypeVar("T")

# Pairs that must all find the other count more than abort_ratio faster
# before a probe switches ahead of its full ``pairs``.
EARLY_SWITCH_PAIRS = 3
# The full probe's median must beat the hysteresis by this many standard
# errors of the step times' noise; over this many recent tied pairs.
NOISE_SIGMAS = 2.0
NOISE_SAMPLES = 64
# A probe whose median is faster but within the noise goes on, up to this
# many times its ``pairs`` in all (like and unlike).
EXTEND_PAIRS = 3
# Or the pairs must favour the other count more often than chance would but
# this often (a sign test; 1/32: five pairs of five).
SIGN_TEST_P = 1 / 32
# How many finished probes the policy remembers (ProbeRecord), for reports.
PROBE_LOG = 16

logger = init_logger(__name__)


class StepShape(NamedTuple):
    """What makes two steps comparable: requests and tokens scheduled."""

    num_reqs: int
    num_tokens: int


class ProbeRecord(NamedTuple):
    """One finished probe: the counts it compared, its pairs' time ratios
    (steps at ``candidate`` over steps at ``threads``), how it ended and
    what it kept."""

    threads: int
    candidate: int
    ratios: tuple[float, ...]
    unlike_pairs: int
    ended: str  # "slower", "faster", "median", "unlike"
    kept: int
    # The unlike pairs of near shapes: their estimated ratios (near_ratio).
    near: tuple[float, ...] = ()


class AdaptiveThreadPolicy:
    """Pick the thread count for each step from how long recent steps took.

    Call ``threads_for_step(shape)`` before a step, run the step with that
    many threads, then ``record_step(seconds)``. Pure bookkeeping: it never
    touches torch (``on_change`` is told of each decided change), so a test
    can drive it with made-up timings.
    """

    def __init__(
        self,
        max_threads: int,
        *,
        pairs: int = 5,
        hysteresis: float = 0.05,
        first_probe: int = 2,
        min_interval: int = 32,
        max_interval: int = 1024,
        abort_ratio: float = 1.25,
        probe_budget: float = 0.03,
        on_change: Callable[[int, int, float], None] | None = None,
    ) -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads must be at least 1, got {max_threads}")
        self.max_threads = max_threads
        self.threads = max_threads
        self.pairs = pairs
        self.hysteresis = hysteresis
        self.min_interval = min_interval
        self.max_interval = max_interval
        self.abort_ratio = abort_ratio
        self.probe_budget = probe_budget
        self.on_change = on_change
        self.interval = min_interval
        self.steps_to_probe = first_probe
        self.probes = 0
        # Each decided change, (old, new), in order.
        self.changes: list[tuple[int, int]] = []
        # The last probes, oldest first: what each measured and why it ended.
        self.probe_log: deque[ProbeRecord] = deque(maxlen=PROBE_LOG)
        self._go_up = False  # the direction of the next probe when both are open
        # The probe in progress: its other count, the pairs' ratios, the
        # half-finished pair, and how many steps it has taken.
        self.candidate: int | None = None
        self._ratios: list[float] = []
        self._first: tuple[StepShape, int, float] | None = None
        self._probe_steps = 0
        self._unlike_pairs = 0
        self._near: list[float] = []  # the unlike pairs' estimated ratios, where near
        self._looked_at = 0  # how many like pairs the last look had
        self._pending: tuple[StepShape, int] | None = None
        # The noise: log time ratios of neighbouring steps of one shape at one
        # count, in a probe or not (what a pair's ratio is when counts tie).
        self._noise: deque[float] = deque(maxlen=NOISE_SAMPLES)
        self._last: tuple[StepShape, int, float] | None = None

    # --- the per-step calls ---------------------------------------------------
    def threads_for_step(self, shape: StepShape) -> int:
        """The count to run the next step with."""
        if self._pending is not None:
            self._last = None  # a step that never reported (it raised) is forgotten
        self._pending = None
        if self.candidate is None:
            if self.steps_to_probe > 0 or self.max_threads == 1:
                self.steps_to_probe -= 1
                self._pending = (shape, self.threads)
                return self.threads
            self._start_probe()
        assert self.candidate is not None
        # Pair i runs (current, candidate) when i is even, the other way when
        # odd, so whatever the first step of a pair pays cancels out.
        pair_index, second = divmod(self._probe_steps, 2)
        on_candidate = (second == 1) != (pair_index % 2 == 1)
        threads = self.candidate if on_candidate else self.threads
        self._pending = (shape, threads)
        return threads

    def record_step(self, seconds: float) -> None:
        """How long the step just run took (its forward pass)."""
        if self._pending is None:
            return
        shape, threads = self._pending
        self._pending = None
        last, self._last = self._last, (shape, threads, seconds)
        if last is not None and last[:2] == (shape, threads) and min(last[2], seconds) > 0:
            self._noise.append(math.log(seconds / last[2]))
        if self.candidate is None:
            return
        self._probe_steps += 1
        if self._first is None:
            self._first = (shape, threads, seconds)
        else:
            first_shape, first_threads, first_seconds = self._first
            self._first = None
            on_candidate, on_current = (
                ((shape, seconds), (first_shape, first_seconds))
                if threads == self.candidate
                else ((first_shape, first_seconds), (shape, seconds))
            )
            if first_threads == threads or min(seconds, first_seconds) <= 0:
                self._unlike_pairs += 1  # a step that never reported broke the pair
            elif first_shape == shape:
                self._ratios.append(on_candidate[1] / on_current[1])
            else:
                self._unlike_pairs += 1
                near = near_ratio(on_candidate, on_current)
                if near is not None:
                    self._near.append(near)
            self._maybe_decide()  # a pair is complete

    def probe_next_step(self) -> None:
        """Start a probe at the next ``threads_for_step``, whatever the wait left."""
        self.steps_to_probe = 0

    # --- the probe --------------------------------------------------------------
    def _start_probe(self) -> None:
        down_open = self.threads > 1
        up_open = self.threads < self.max_threads
        go_up = up_open and (self._go_up or not down_open)
        self.candidate = self.threads + 1 if go_up else self.threads - 1
        self._go_up = not go_up
        self._ratios = []
        self._first = None
        self._probe_steps = 0
        self._unlike_pairs = 0
        self._near = []
        self._looked_at = 0
        self.probes += 1

    def _maybe_decide(self) -> None:
        assert self.candidate is not None
        ratios = self._ratios
        out_of_pairs = len(ratios) + self._unlike_pairs >= EXTEND_PAIRS * self.pairs
        # Near pairs stand in for like ones only while there are none.
        compared = ratios or self._near
        if compared and min(compared) > self.abort_ratio:
            self._end_probe(None, "slower")  # clearly slower: stop paying for it at once
        elif len(ratios) >= EARLY_SWITCH_PAIRS and max(ratios) < 1 / self.abort_ratio:
            # Clearly faster three times over (so their median is too).
            self._end_probe(statistics.median(ratios), "faster")
        elif len(ratios) >= self.pairs and (
            (len(ratios) % self.pairs == 0 and len(ratios) != self._looked_at) or out_of_pairs
        ):
            # Looked at once after every `pairs` like pairs (fewer looks, fewer
            # chances for noise to pass), and when the probe is out of pairs.
            self._looked_at = len(ratios)
            ratio = statistics.median(ratios)
            leaning = ratio < 1 - self.hysteresis
            if leaning and (
                ratio * self._noise_allowance() < 1 - self.hysteresis
                or sign_test(ratios) <= SIGN_TEST_P
            ):
                self._end_probe(ratio, "median")
            elif not leaning or out_of_pairs:
                self._end_probe(None, "median")
            # Else faster by its median, not yet beyond the noise: more pairs
            # (the allowance shrinks as one over their root). Beside a busy
            # core the steps at the count that stalls vary twofold and five
            # pairs (2 vs 1: 0.45 0.45 0.88 0.78 0.77) kept two threads at
            # 110 tok/s where one ran 210; the extra steps run at the count
            # that looks faster, so they cost little when it is.
        elif len(ratios) < self.pairs and self._unlike_pairs >= self.pairs:
            # As many pairs of unlike shapes as a probe has pairs: the steps
            # at the other count (at most 2 * pairs) decided nothing; later.
            self._end_probe(None, "unlike")

    def _noise_allowance(self) -> float:
        """How much faster than its median the other count might look by
        chance: ``NOISE_SIGMAS`` standard errors of a median of the probe's
        pairs, the spread measured on tied steps and on the pairs themselves."""
        logs = [math.log(r) for r in self._ratios]
        mid = statistics.median(logs)
        spread = [abs(x) for x in self._noise] + [abs(x - mid) for x in logs]
        sigma = 1.4826 * statistics.median(spread)  # robust: a load change is an outlier
        return math.exp(NOISE_SIGMAS * 1.2533 * sigma / math.sqrt(len(logs)))

    def _end_probe(self, faster_ratio: float | None, ended: str) -> None:
        assert self.candidate is not None
        candidate, self.candidate = self.candidate, None
        self._first = None
        kept = self.threads if faster_ratio is None else candidate
        record = ProbeRecord(
            self.threads, candidate, tuple(self._ratios), self._unlike_pairs, ended, kept,
            tuple(self._near),
        )  # fmt: skip
        self.probe_log.append(record)
        logger.debug("CPU threads probe: %s", format_probe(record))
        if faster_ratio is None:
            # What the probe's slower steps cost, in steps at the kept count:
            # the wait grows so that probing stays within the budget.
            cost = sum(max(r - 1, 0.0) for r in (*self._ratios, *self._near))
            wait = max(self.interval * 2, math.ceil(cost / self.probe_budget))
            self.interval = min(wait, self.max_interval)
        else:
            old, self.threads = self.threads, candidate
            self.changes.append((old, candidate))
            # The probe back waits twice the shortest interval: a switch that
            # noise made is not undone (and redone) at once.
            self.interval = min(2 * self.min_interval, self.max_interval)
            if self.on_change is not None:
                self.on_change(old, candidate, faster_ratio)
        self.steps_to_probe = self.interval


# Two decode batches whose sizes differ by at most this fraction of the
# larger are compared (near_ratio).
NEAR_SHAPES = 1 / 8


def near_ratio(
    on_candidate: tuple[StepShape, float], on_current: tuple[StepShape, float]
) -> float | None:
    """A pair of steps of unlike shapes, (shape, seconds) at the candidate
    count and at the current one, when both are decode steps (a token per
    request) whose sizes differ by at most ``NEAR_SHAPES``: how much slower
    the candidate's step was, estimated toward a tie; else None.

    A step's time grows with its batch, but less than in proportion (it
    also reads every weight once): the ratio of the two times errs toward
    the step on the smaller batch, the ratio of times per token toward the
    larger one. The candidate's true ratio lies between the two, so the
    smaller of them never overstates how much slower it was."""
    (a, a_s), (b, b_s) = on_candidate, on_current
    decodes = a.num_reqs == a.num_tokens > 0 and b.num_reqs == b.num_tokens > 0
    apart = abs(a.num_tokens - b.num_tokens) / max(a.num_tokens, b.num_tokens, 1)
    if not decodes or apart > NEAR_SHAPES:
        return None
    return min(a_s / b_s, (a_s / a.num_tokens) / (b_s / b.num_tokens))


def sign_test(ratios: list[float]) -> float:
    """How likely, were the two counts equally fast, as many of the pairs
    or more would favour the other count (ratio < 1) as did: each pair is
    then a coin toss. Blind to how far a pair leans, so a stalled step
    twice as long counts no more than any other."""
    n, k = len(ratios), sum(r < 1 for r in ratios)
    return sum(math.comb(n, i) for i in range(k, n + 1)) / 2**n


def run_step(
    policy: AdaptiveThreadPolicy,
    execute_model: Callable[..., T],
    scheduler_output: SchedulerOutput,
    *args: Any,
) -> T:
    """``execute_model(scheduler_output, *args)`` with the thread count the
    policy picks for a step of its shape, its time then told to the policy."""
    shape = StepShape(
        len(scheduler_output.num_scheduled_tokens), scheduler_output.total_num_scheduled_tokens
    )
    threads = policy.threads_for_step(shape)
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    start = time.perf_counter()
    output = execute_model(scheduler_output, *args)
    policy.record_step(time.perf_counter() - start)
    return output


# The warm-up probe's dummy steps: a decode-sized batch, at most this many tokens.
WARM_UP_PROBE_TOKENS = 32


def probe_at_warm_up(
    policy: AdaptiveThreadPolicy, dummy_run: Callable[[int], object], max_num_tokens: int
) -> int:
    """The policy's first probe, run on dummy forward passes
    (``dummy_run(num_tokens)``: ``ModelRunner._dummy_run``) before the first
    request; returns how many it ran (timed ones; one more ran untimed first).

    Without it the first probe ran on the first requests' steps, where a
    server's shapes rarely repeat (arrivals, prefills beside decodes): under
    load, ``make bench-serve``'s 32 prefills then ran at both threads beside
    the busy core in one run of two (TTFT p50 5.3 s against 2.7). The dummy
    steps all have one shape, so every pair counts: a neighbour much slower
    costs one pair (quiet: two dummy steps), one much faster is taken after
    three, else the probe's ``pairs`` (up to three times as many when it
    leans but has not yet convinced). The count it keeps then holds for the
    first requests, and the probes between steps go on as before.
    """
    if policy.max_threads == 1:
        return 0
    num_tokens = min(WARM_UP_PROBE_TOKENS, max_num_tokens)
    shape = StepShape(num_reqs=0, num_tokens=num_tokens)  # no real step has zero requests
    # No spans: these forwards belong to no step, and would each open a trace.
    with tracing.untraced():
        try:
            dummy_run(num_tokens)  # untimed: whatever the first forward at this size sets up
            policy.probe_next_step()
            steps = 0
            # Bounded by the probe's own rules; the bound here only guards them.
            while steps < 2 * EXTEND_PAIRS * policy.pairs + 2:
                threads = policy.threads_for_step(shape)
                torch.set_num_threads(threads)
                start = time.perf_counter()
                dummy_run(num_tokens)
                policy.record_step(time.perf_counter() - start)
                steps += 1
                if policy.candidate is None:  # decided
                    break
        finally:
            torch.set_num_threads(policy.threads)  # not a candidate's, even on an error
    return steps


def format_probe(record: ProbeRecord) -> str:
    """One line for a probe: ``2 vs 1: 0.52 0.55 0.49 -> 1 (faster)``."""
    ratios = " ".join(f"{r:.2f}" for r in record.ratios) or "no like pairs"
    unlike = f", {record.unlike_pairs} unlike" if record.unlike_pairs else ""
    if record.near:
        unlike += f" ({' '.join(f'{r:.2f}' for r in record.near)} near)"
    return (
        f"{record.threads} vs {record.candidate}: {ratios}{unlike} "
        f"-> {record.kept} ({record.ended})"
    )


def log_change(old: int, new: int, ratio: float) -> None:
    logger.info(
        "CPU threads: %d -> %d (steps at %d took %.0f%% of those at %d; "
        "TRACEVLLM_CPU_ADAPTIVE_THREADS=0 or TRACEVLLM_NUM_THREADS fixes the count)",
        old,
        new,
        new,
        ratio * 100,
        old,
    )
