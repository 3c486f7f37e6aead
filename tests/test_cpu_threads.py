"""The adaptive CPU thread count: the policy's decisions on made-up step
timings, and the engine running with it (the count on each step span)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tracevllm.worker.cpu_threads import (
    AdaptiveThreadPolicy,
    ProbeRecord,
    StepShape,
    format_probe,
    near_ratio,
    probe_at_warm_up,
    sign_test,
)

DECODE = StepShape(num_reqs=8, num_tokens=8)


def drive(
    policy: AdaptiveThreadPolicy,
    seconds: Callable[[int, StepShape], float],
    steps: int,
    shape: Callable[[int], StepShape] = lambda i: DECODE,
) -> list[int]:
    """Run ``steps`` steps, each timed by ``seconds(threads, shape)``; the
    counts the policy asked for, step by step."""
    asked = []
    for i in range(steps):
        s = shape(i)
        threads = policy.threads_for_step(s)
        asked.append(threads)
        policy.record_step(seconds(threads, s))
    return asked


def per_thread(table: dict[int, float]) -> Callable[[int, StepShape], float]:
    return lambda threads, shape: table[threads]


def test_takes_one_fewer_when_faster_by_more_than_the_hysteresis() -> None:
    """Mutation caught: the decision `ratio < 1 - hysteresis` turned into
    `ratio > 1 + hysteresis` (the count then stays at 2)."""
    changes: list[tuple[int, int, float]] = []
    policy = AdaptiveThreadPolicy(2, on_change=lambda *c: changes.append(c))
    assert policy.threads == 2
    drive(policy, per_thread({2: 1.0, 1: 0.4}), 40)  # one busy core: 2 threads stall
    assert policy.threads == 1
    assert changes and changes[0][:2] == (2, 1) and changes[0][2] == pytest.approx(0.4)


@pytest.mark.parametrize("one_thread", [1.45, 0.97, 1.0])
def test_keeps_the_count_unless_the_other_is_faster_beyond_the_hysteresis(
    one_thread: float,
) -> None:
    """Slower, or faster by less than the hysteresis (3 % < 5 %): kept.
    Mutation caught: the hysteresis dropped (`ratio < 1`), then 0.97 switches."""
    policy = AdaptiveThreadPolicy(2, hysteresis=0.05)
    asked = drive(policy, per_thread({2: 1.0, 1: one_thread}), 300)
    assert policy.threads == 2
    assert policy.probes >= 2  # it did look
    assert 1 in asked


def test_reprobes_and_follows_the_load_back() -> None:
    """Under load it moves to 1; when the load is gone, a later probe moves it
    back to 2. Mutation caught: no re-probe after a probe ends
    (`steps_to_probe = self.interval` replaced by a huge number)."""
    policy = AdaptiveThreadPolicy(2)
    drive(policy, per_thread({2: 1.0, 1: 0.4}), 60)
    assert policy.threads == 1
    drive(policy, per_thread({2: 0.7, 1: 1.0}), 200)  # quiet again
    assert policy.threads == 2


def test_probes_less_often_while_nothing_changes() -> None:
    """Each probe that keeps the count doubles the wait, up to max_interval.
    Mutation caught: the interval not doubled (probes stay every 32 steps)."""
    policy = AdaptiveThreadPolicy(2, min_interval=32, max_interval=128)
    drive(policy, per_thread({2: 1.0, 1: 1.5}), 1000)
    # Probes start at 8, 8+32+4, then every 64, then every 128 (plus their own steps).
    assert 7 <= policy.probes <= 10
    assert policy.interval == 128


@pytest.mark.parametrize("faster", ["fewer", "more"])
def test_never_below_one_nor_above_the_maximum(faster: str) -> None:
    """However the timings pull, every count asked for is in [1, max].
    Mutation caught: `down_open = self.threads > 1` turned into `>= 1`
    (a probe at 0 threads), or `up_open` into `<=` (a probe at max + 1)."""

    def seconds(threads: int, shape: StepShape) -> float:
        assert 1 <= threads <= 4, threads
        return float(threads) if faster == "fewer" else 1.0 / threads

    policy = AdaptiveThreadPolicy(4, min_interval=8)
    asked = drive(policy, seconds, 600)
    assert min(asked) >= 1 and max(asked) <= 4
    assert policy.threads == (1 if faster == "fewer" else 4)
    assert (1 if faster == "fewer" else 4) in asked


def test_only_steps_of_the_same_shape_are_compared() -> None:
    """Shapes alternate step by step, so no pair is like; the small step's
    time must not count for the other count. Mutation caught: the shape
    check dropped (`like = first_threads != threads`): 1 thread would look
    ten times faster and be taken."""
    small, big = StepShape(1, 1), StepShape(64, 64)

    def seconds(threads: int, shape: StepShape) -> float:
        return (0.1 if shape == small else 1.0) * (1.0 if threads == 2 else 1.1)

    changes: list[Any] = []
    policy = AdaptiveThreadPolicy(2, on_change=lambda *c: changes.append(c))
    drive(policy, seconds, 400, shape=lambda i: small if i % 2 else big)
    assert policy.threads == 2 and changes == []


def test_a_probe_with_no_like_pairs_stops_after_pairs_candidate_steps() -> None:
    """Shapes alternate (serving, chunked prefills): no pair is like, so
    nothing can decide; the probe ends after `pairs` unlike pairs, at most
    2 * pairs steps at the other count, not 20. Mutation caught: the old end
    (`_probe_steps >= 4 * pairs * 2`: 20 steps at 1 thread)."""
    small, big = StepShape(1, 1), StepShape(64, 64)
    policy = AdaptiveThreadPolicy(2, first_probe=0, pairs=5)
    asked = []
    for i in range(200):
        asked.append(policy.threads_for_step(small if i % 2 else big))
        policy.record_step(1.0)
        if policy.candidate is None:
            break
    assert policy.candidate is None and policy.threads == 2
    assert asked.count(1) <= 2 * policy.pairs, asked


def test_a_much_slower_probe_stops_at_its_first_pair() -> None:
    """A neighbour 2.5x slower costs one step, not the five of a full probe.
    Mutation caught: the early stop removed."""
    policy = AdaptiveThreadPolicy(2, first_probe=0)
    asked = drive(policy, per_thread({2: 1.0, 1: 2.5}), 20)
    assert asked.count(1) == 1
    assert policy.threads == 2 and policy.candidate is None


def test_a_much_faster_neighbour_is_taken_after_three_pairs() -> None:
    """Three times more than 1.25x faster: taken after six steps, not ten;
    two such pairs are not enough (noise makes those). Mutation caught:
    EARLY_SWITCH_PAIRS 2 (taken after four steps); the early switch removed
    (the fifth pair decides)."""
    policy = AdaptiveThreadPolicy(2, first_probe=0)
    asked = drive(policy, per_thread({2: 1.0, 1: 0.1}), 4)
    assert policy.threads == 2 and policy.candidate == 1
    asked += drive(policy, per_thread({2: 1.0, 1: 0.1}), 2)
    assert policy.threads == 1 and asked == [2, 1, 1, 2, 2, 1]


def test_after_a_switch_the_probe_back_waits_twice_the_shortest_interval() -> None:
    """A switch noise made is not undone at once: the next probe comes
    2 * min_interval steps later. Mutation caught: the interval after a
    switch back to min_interval (the probe comes 16 steps sooner)."""
    policy = AdaptiveThreadPolicy(2, first_probe=0, min_interval=16)
    drive(policy, per_thread({2: 1.0, 1: 0.1}), 6)
    assert policy.threads == 1 and policy.candidate is None
    asked = drive(policy, per_thread({2: 1.0, 1: 0.1}), 34)
    # 32 steps, then the probe's first pair: (current, candidate).
    assert asked == [1] * 33 + [2]


@pytest.mark.parametrize("seed", range(8))
def test_noise_of_a_shared_machine_changes_the_count_at_most_once(seed: int) -> None:
    """Equal counts with +-25 % noise per step (this machine under others'
    work): over 2000 steps, at most one change. Mutation caught: the noise
    allowance dropped (NOISE_SIGMAS 0: 3 to 5 changes in each seed)."""
    rng = random.Random(seed)
    changes: list[Any] = []
    policy = AdaptiveThreadPolicy(2, on_change=lambda *c: changes.append(c))
    drive(policy, lambda t, s: 1.0 + rng.uniform(-0.25, 0.25), 2000)
    assert policy.probes >= 5
    assert len(changes) <= 1, changes


def test_under_noise_a_clear_gain_is_still_taken() -> None:
    """The allowance for noise does not hide a busy core: one thread 2.5x
    faster under +-25 % noise is taken at the first probe."""
    rng = random.Random(0)
    policy = AdaptiveThreadPolicy(2)
    drive(policy, lambda t, s: {2: 1.0, 1: 0.4}[t] * (1 + rng.uniform(-0.25, 0.25)), 20)
    assert policy.threads == 1


def stalling_core(rng: random.Random) -> Callable[[int, StepShape], float]:
    """Step times beside one busy core, as measured (make bench, tracing
    full): at two threads a step is stalled or not, 2.2 or 1.0 (+-10 %), at
    one thread 0.8 (+-30 %): a pair's ratio from 0.25 to 1.1."""

    def seconds(threads: int, shape: StepShape) -> float:
        if threads == 1:
            return 0.8 * (1 + rng.uniform(-0.3, 0.3))
        return (2.2 if rng.random() < 0.5 else 1.0) * (1 + rng.uniform(-0.1, 0.1))

    return seconds


@pytest.mark.parametrize("seed", range(16))
def test_beside_a_stalling_core_one_thread_is_taken(seed: int) -> None:
    """The two-thread steps vary twofold, so five pairs' median can be
    within the noise allowance, and a pair can favour two threads: the probe
    goes on to more pairs and takes one thread, with no second probe.
    Mutation caught: EXTEND_PAIRS 1 (seeds 10 and 15 keep two threads after
    40 steps: the run that made 110 tok/s, not 210)."""
    policy = AdaptiveThreadPolicy(2, first_probe=0)
    drive(policy, stalling_core(random.Random(seed)), 40)
    assert policy.threads == 1 and policy.probes == 1
    (record,) = policy.probe_log
    assert (record.threads, record.candidate, record.kept) == (2, 1, 1)


def test_five_pairs_all_favouring_the_other_count_are_enough() -> None:
    """A probe measured beside a busy core (make bench, tracing full; it
    kept two threads at 110 tok/s where one ran 210): one thread won all
    five pairs (0.45 0.45 0.88 0.78 0.77), but the two-thread steps before
    it varied 2.2x step to step, so the median is within the noise
    allowance. The sign test (five of five: 1 in 32 by chance) takes one
    thread at the first look. Mutation caught: SIGN_TEST_P 0 (the probe
    goes on past ten steps)."""
    before = [1.0, 2.2] * 16  # the 32 steps before the probe, at two threads
    at_two = [2.0, 2.0, 1.0, 1.1, 1.1]  # each pair's two-thread step
    ratios = [0.45, 0.45, 0.88, 0.78, 0.77]
    policy = AdaptiveThreadPolicy(2, first_probe=len(before))
    times = iter(before)
    drive(policy, lambda t, s: next(times), len(before))
    assert policy.candidate is None and policy.threads == 2
    for two, ratio in zip(at_two, ratios, strict=True):
        for _ in range(2):  # a pair: one step at each count, in either order
            threads = policy.threads_for_step(DECODE)
            policy.record_step(two if threads == 2 else two * ratio)
    assert policy._noise_allowance() * 0.77 > 0.95  # within the noise by the median test
    assert policy.threads == 1 and policy.candidate is None
    assert policy.probe_log[-1].ratios == pytest.approx(ratios)


def test_sign_test() -> None:
    """The chance of k or more of n pairs favouring the other count when
    each is a coin toss."""
    assert sign_test([0.9] * 5) == 1 / 32
    assert sign_test([0.9] * 4 + [1.1]) == 6 / 32
    assert sign_test([0.9] * 9 + [1.1]) == 11 / 1024
    assert sign_test([1.1, 1.0]) == 1.0  # a tie favours neither


def test_a_leaning_probe_is_looked_at_once_per_pairs_like_pairs() -> None:
    """Five like pairs leaning to one thread but not convincing (four of
    five, within the noise), then unlike pairs: one look at the five, none
    at each unlike pair (each look is another chance for noise to pass).
    Mutation caught: the `_looked_at` guard dropped (a look per unlike pair)."""
    policy = AdaptiveThreadPolicy(2, first_probe=0)
    looks = []
    allowance = policy._noise_allowance
    policy._noise_allowance = lambda: looks.append(len(policy._ratios)) or allowance()  # type: ignore[method-assign]
    at_two = [1.0, 2.0, 1.0, 2.0, 1.0]
    for two, ratio in zip(at_two, [0.8, 0.7, 1.1, 0.85, 0.75], strict=True):
        for _ in range(2):
            threads = policy.threads_for_step(DECODE)
            policy.record_step(two if threads == 2 else two * ratio)
    assert looks == [5] and policy.candidate == 1  # leaning: the probe goes on
    for i in range(8):  # four unlike pairs
        policy.threads_for_step(StepShape(i + 20, i + 20))
        policy.record_step(1.0)
    assert looks == [5] and policy.candidate == 1 and policy._unlike_pairs == 4


def test_a_probe_runs_at_most_three_times_its_pairs() -> None:
    """A tie under heavy noise: however often the median leans to the other
    count, no probe takes more than 3 * pairs pairs (steps at the other
    count). Mutation caught: the bound dropped (`out_of_pairs` False: a
    leaning probe with unlike pairs among its like ones never ends)."""
    rng = random.Random(0)
    shapes = [DECODE, StepShape(9, 9)]
    policy = AdaptiveThreadPolicy(2, first_probe=0, pairs=5)
    for _ in range(50):
        steps = 0
        while True:  # one probe, its shapes like and unlike at random
            policy.threads_for_step(rng.choice(shapes))
            policy.record_step(1.0 + rng.uniform(-0.6, 0.6))
            steps += 1
            if policy.candidate is None:
                break
            assert steps <= 2 * 3 * policy.pairs, policy.probe_log
        policy.probe_next_step()
    lengths = [len(r.ratios) + r.unlike_pairs for r in policy.probe_log]
    assert max(lengths) <= 3 * policy.pairs


def test_each_probe_is_recorded_with_its_ratios() -> None:
    """probe_log keeps each probe's pairs, how it ended and what it kept;
    format_probe writes the line get_cpu_threads reports."""
    policy = AdaptiveThreadPolicy(2, first_probe=0)
    drive(policy, per_thread({2: 1.0, 1: 2.5}), 1 + 1)  # a much slower neighbour
    (record,) = policy.probe_log
    assert record == ProbeRecord(2, 1, (2.5,), 0, "slower", 2)
    assert format_probe(record) == "2 vs 1: 2.50 -> 2 (slower)"
    policy.probe_next_step()
    drive(policy, per_thread({2: 1.0, 1: 0.4}), 6)  # then much faster
    assert format_probe(policy.probe_log[-1]) == "2 vs 1: 0.40 0.40 0.40 -> 1 (faster)"


def test_a_costly_probe_waits_longer() -> None:
    """A neighbour 10x slower cost 9 steps' worth: the next probe waits
    9 / 3% = 300 steps, not 64. Mutation caught: the cost term dropped."""
    policy = AdaptiveThreadPolicy(2, first_probe=0, min_interval=32)
    drive(policy, per_thread({2: 1.0, 1: 10.0}), 2)
    assert policy.candidate is None and policy.interval == 300


def test_noise_within_the_hysteresis_does_not_flap() -> None:
    """Equal counts with +-3 % noise: over many probes the count never moves.
    Mutation caught: the median replaced by the minimum of the ratios."""
    rng = random.Random(0)
    changes: list[Any] = []
    policy = AdaptiveThreadPolicy(
        2, min_interval=8, max_interval=8, on_change=lambda *c: changes.append(c)
    )
    drive(policy, lambda t, s: 1.0 + rng.uniform(-0.03, 0.03), 2000)
    assert policy.probes > 50
    assert changes == []


def test_a_step_that_never_reported_is_forgotten() -> None:
    """A step that raised (no record_step) leaves no half pair behind."""
    policy = AdaptiveThreadPolicy(2, first_probe=0)
    policy.threads_for_step(DECODE)  # raised: never recorded
    drive(policy, per_thread({2: 1.0, 1: 0.5}), 30)
    assert policy.threads == 1


def test_one_thread_never_probes() -> None:
    policy = AdaptiveThreadPolicy(1)
    assert set(drive(policy, per_thread({1: 1.0}), 100)) == {1}
    assert policy.probes == 0
    with pytest.raises(ValueError, match="max_threads must be at least 1"):
        AdaptiveThreadPolicy(0)


# --- the first probe, on the warm-up's dummy steps ------------------------------
def sleeper(seconds_at: dict[int, float]) -> Callable[[int], None]:
    """A dummy step that takes as long as the table says for the count torch
    runs at now (the count probe_at_warm_up set), and counts its calls. Its
    time passes on the probe's clock (``torch_threads`` makes it a fake one),
    so a loaded CI machine cannot change what the probe measures."""

    def step(num_tokens: int) -> None:
        step.calls += 1  # type: ignore[attr-defined]
        FAKE_CLOCK[0] += seconds_at[torch.get_num_threads()]

    step.calls = 0  # type: ignore[attr-defined]
    return step


FAKE_CLOCK = [0.0]


@pytest.fixture
def torch_threads(monkeypatch: pytest.MonkeyPatch) -> Any:
    """torch at 2 threads (given back after), and cpu_threads' clock the fake one."""
    import types

    from tracevllm.worker import cpu_threads

    monkeypatch.setattr(
        cpu_threads, "time", types.SimpleNamespace(perf_counter=lambda: FAKE_CLOCK[0])
    )
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_warm_up_probe_takes_a_much_faster_count_before_any_step(torch_threads: None) -> None:
    """One thread five times faster: taken after three pairs of dummy steps
    (one untimed first), and torch left at it, so the first real step runs
    there. Mutation caught: the dummy steps not run at the count the policy
    asked for (no torch.set_num_threads in the loop: every pair ties)."""
    policy = AdaptiveThreadPolicy(2)
    step = sleeper({1: 0.002, 2: 0.010})
    assert probe_at_warm_up(policy, step, 64) == 6
    assert step.calls == 7  # type: ignore[attr-defined]
    assert policy.threads == 1 and policy.changes == [(2, 1)] and policy.probes == 1
    assert torch.get_num_threads() == 1
    assert policy.threads_for_step(DECODE) == 1  # no second probe yet
    assert policy.candidate is None


def test_warm_up_probe_beside_a_stalling_core_ends_before_the_first_request(
    torch_threads: None,
) -> None:
    """Beside a busy core (``stalling_core``'s timings) a probe can need more
    than five pairs: the warm-up runs each to its end and leaves no probe
    half done for the first requests; nearly every seed takes one thread.
    Mutation caught: the loop's bound at its old 2 * pairs + 2 steps (seed
    11 left running)."""
    took_one = 0
    for seed in range(16):
        seconds = stalling_core(random.Random(seed))

        def step(num_tokens: int, seconds: Callable[..., float] = seconds) -> None:
            FAKE_CLOCK[0] += seconds(torch.get_num_threads(), DECODE)

        torch.set_num_threads(2)
        policy = AdaptiveThreadPolicy(2)
        probe_at_warm_up(policy, step, 64)
        assert policy.candidate is None, (seed, policy.probe_log)
        assert torch.get_num_threads() == policy.threads
        took_one += policy.threads == 1
    assert took_one >= 14


def test_warm_up_probe_keeps_a_faster_count_for_one_pair(torch_threads: None) -> None:
    """Fewer threads five times slower (a quiet machine): one pair, nothing
    changed, torch back at 2, and the next probe waits (its interval doubled,
    more when the slow steps cost more than the probe budget)."""
    policy = AdaptiveThreadPolicy(2, min_interval=32)
    step = sleeper({1: 0.010, 2: 0.002})
    assert probe_at_warm_up(policy, step, 64) == 2
    assert policy.threads == 2 and policy.changes == [] and policy.probes == 1
    assert torch.get_num_threads() == 2
    assert policy.steps_to_probe >= 64  # twice the interval, or more for a costly probe


def test_warm_up_probe_makes_no_spans(torch_threads: None) -> None:
    """The dummy steps belong to no step: under a recording span, each runs
    in an unsampled context (tracing.untraced), so the forward's spans are
    not recorded and open no trace. Mutation caught: the probe outside
    ``tracing.untraced()``."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    sampled: list[bool] = []
    step = sleeper({1: 0.002, 2: 0.010})

    def traced_step(num_tokens: int) -> None:
        sampled.append(trace.get_current_span().get_span_context().trace_flags.sampled)
        step(num_tokens)

    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("outer"):
        assert trace.get_current_span().get_span_context().trace_flags.sampled
        probe_at_warm_up(AdaptiveThreadPolicy(2), traced_step, 64)
    assert sampled and not any(sampled)


def test_warm_up_probe_with_one_thread_runs_nothing(torch_threads: None) -> None:
    step = sleeper({1: 0.0, 2: 0.0})
    assert probe_at_warm_up(AdaptiveThreadPolicy(1), step, 64) == 0
    assert step.calls == 0  # type: ignore[attr-defined]


# --- the engine -----------------------------------------------------------------
class ForcedPolicy(AdaptiveThreadPolicy):
    """The worker's policy, made to act within a short run: it probes at once
    and every few steps, and each step is timed as if fewer threads were ten
    times faster. It keeps the counts it asked for, step by step."""

    def __init__(self, max_threads: int, **kwargs: Any) -> None:
        super().__init__(max_threads, first_probe=0, min_interval=2, **kwargs)
        self.asked: list[int] = []

    def threads_for_step(self, shape: StepShape) -> int:
        threads = super().threads_for_step(shape)
        self.asked.append(threads)
        return threads

    def record_step(self, seconds: float) -> None:
        if self._pending is not None:
            seconds = 0.1 if self._pending[1] < self.max_threads else 1.0
        super().record_step(seconds)


class EngineRun(NamedTuple):
    counts: list[int | None]  # tracevllm.num_threads, step span by step span
    policy: Any
    threads_after: int  # the process's torch count once the engine shut down
    report: dict[str, Any]  # llm.collective_rpc("get_cpu_threads") after the run
    warm_up_steps: int  # the worker's warm-up probe's timed dummy steps


def _run_engine(tiny_model_dir: str) -> EngineRun:
    """An in-process engine (its worker in this process), 2 prompts x 16
    greedy tokens, its step spans captured."""
    from tracevllm import LLM, SamplingParams

    exporter = InMemorySpanExporter()
    with LLM(model=tiny_model_dir, enable_multiprocessing=False, trace_detail="request") as llm:
        provider = llm.llm_engine.tracer_provider
        assert provider is not None
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        llm.generate(["Hello there, how", "The capital of"], params, use_tqdm=False)
        worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
        policy = worker.thread_policy
        warm_up_steps = worker.warm_up_probe_steps
        (report,) = llm.collective_rpc("get_cpu_threads")
    steps = [s for s in exporter.get_finished_spans() if s.name == "EngineCore.step"]
    assert steps
    counts = [(s.attributes or {}).get("tracevllm.num_threads") for s in steps]
    return EngineRun(counts, policy, torch.get_num_threads(), report, warm_up_steps)


@pytest.fixture(scope="module")
def engine_runs(tiny_model_dir: str) -> dict[str, EngineRun]:
    """Two in-process engines from a process at 2 torch threads: the default
    (adaptive, with ForcedPolicy) and TRACEVLLM_NUM_THREADS=1."""
    before = torch.get_num_threads()
    runs = {}
    with pytest.MonkeyPatch.context() as mp:
        for name in (
            "TRACEVLLM_NUM_THREADS",
            "TRACEVLLM_CPU_NUM_OF_RESERVED_CPU",
            "TRACEVLLM_CPU_ADAPTIVE_THREADS",
        ):
            mp.delenv(name, raising=False)
        mp.setattr("tracevllm.worker.worker.AdaptiveThreadPolicy", ForcedPolicy)
        torch.set_num_threads(2)
        try:
            runs["adaptive"] = _run_engine(tiny_model_dir)
            torch.set_num_threads(2)
            mp.setenv("TRACEVLLM_NUM_THREADS", "1")
            runs["fixed"] = _run_engine(tiny_model_dir)
        finally:
            torch.set_num_threads(before)
    return runs


def test_engine_step_spans_show_the_count_the_policy_changed_to(
    engine_runs: dict[str, EngineRun],
) -> None:
    """By default the count adapts: each step ran at the count the policy
    asked for (the probe's 2, 1, 1, 2 ..., then 1 once it switched), and its
    span says so. TRACEVLLM_NUM_THREADS fixes it (no policy, that count on
    every span). Mutations caught: run_step never calling
    torch.set_num_threads (every span says 2); `_record_num_threads` not
    called from records.step."""
    run = engine_runs["adaptive"]
    policy = run.policy
    assert isinstance(policy, ForcedPolicy) and policy.max_threads == 2
    assert policy.threads == 1 and policy.probes >= 2  # it switched, and looked back
    # The first probe ran on the warm-up's dummy steps (three pairs: 1 was
    # ten times faster), so the first request's first step already ran at 1.
    # Mutation caught: Worker.compile_or_warm_up_model not calling
    # probe_at_warm_up (no warm-up steps; the first step at 2).
    assert run.warm_up_steps == 6
    assert run.counts == policy.asked[run.warm_up_steps :], (run.counts, policy.asked)
    assert run.counts[0] == 1
    assert 2 in run.counts and run.counts[-1] == 1
    fixed = engine_runs["fixed"]
    assert fixed.policy is None
    assert set(fixed.counts) == {1}
    # What the worker reports (make bench records it): the count it ended at,
    # every change in order, and each probe's line (the warm-up's first).
    assert run.report == {"threads": 1, "adaptive": True, "probes": policy.probes,
                          "changes": [[2, 1], *[list(c) for c in policy.changes[1:]]],
                          "probe_log": [format_probe(r) for r in policy.probe_log]}  # fmt: skip
    assert run.report["probe_log"][0] == "2 vs 1: 0.10 0.10 0.10 -> 1 (faster)"
    assert policy.changes and policy.changes[0] == (2, 1) and policy.changes[-1][1] == 1
    assert fixed.report == {
        "threads": 1, "adaptive": False, "changes": [], "probes": 0, "probe_log": []
    }  # fmt: skip


@pytest.mark.parametrize("name", ["adaptive", "fixed"])
def test_an_in_process_engine_gives_the_thread_count_back(
    engine_runs: dict[str, EngineRun], name: str
) -> None:
    """Both engines left this process at 1 thread; Worker.shutdown gives back
    the 2 it found. Mutation caught: the restore in Worker.shutdown removed
    (1 after either engine)."""
    assert engine_runs[name].counts[-1] == 1
    assert engine_runs[name].threads_after == 2


def test_overlapping_in_process_workers_give_back_the_count_the_process_had(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two in-process engines overlap: the first sets 1 thread, the second
    starts while it runs (and finds 1), the first shuts down, then the
    second: the process ends at the count it had before either (mutation
    caught: each worker restoring the count it found -> the process ends at 1)."""
    from tracevllm.worker import worker

    # This process's history (engines of earlier tests) is not the subject.
    monkeypatch.setattr(worker, "_PROCESS_THREADS", {"live": 0, "before": 0})
    claim_process_threads, release_process_threads = (
        worker.claim_process_threads,
        worker.release_process_threads,
    )

    user = torch.get_num_threads()
    torch.set_num_threads(2)  # the user's process, before either engine
    before = 2
    try:
        assert claim_process_threads() == before  # engine A starts
        torch.set_num_threads(1)  # A's count
        assert claim_process_threads() == before  # engine B starts, finds 1
        release_process_threads()  # A shuts down: B still runs
        assert torch.get_num_threads() == 1
        release_process_threads()  # B shuts down
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(user)


def shrinking(start: int) -> Callable[[int], StepShape]:
    """A run's tail: one request fewer every step, so no two steps share a shape."""
    return lambda i: StepShape(start - i, start - i)


def per_token(table: dict[int, float]) -> Callable[[int, StepShape], float]:
    return lambda threads, shape: table[threads] * shape.num_tokens


def test_near_decode_pairs_stop_a_slower_probe_at_its_first_pair() -> None:
    """Decode batches one request smaller each step: no pair is like, but each
    pair is near (64 and 63), and per token the other count is 1.8x slower:
    the probe ends after one step at it, not after `pairs` unlike pairs.
    Mutation caught: the near pairs left out of the first test (five steps at
    1 thread)."""
    policy = AdaptiveThreadPolicy(2, first_probe=0, pairs=5)
    asked = drive(policy, per_token({2: 1.0, 1: 1.8}), 2, shape=shrinking(64))
    assert asked.count(1) == 1 and policy.candidate is None and policy.threads == 2
    (record,) = policy.probe_log
    assert record.ratios == () and record.unlike_pairs == 1 and record.ended == "slower"
    assert record.near == pytest.approx((1.8 * 63 / 64,))  # the estimate toward a tie
    assert format_probe(record) == "2 vs 1: no like pairs, 1 unlike (1.77 near) -> 2 (slower)"


def test_near_pairs_never_make_a_switch() -> None:
    """Per token twice as fast at 1 thread, but only near pairs to show it: the
    probe ends after its unlike pairs and the count stays (a per-token ratio is
    off by a few percent; it may stop a probe, not change the count). Mutation
    caught: near pairs counted as like (then 1 thread is taken)."""
    changes: list[Any] = []
    policy = AdaptiveThreadPolicy(2, first_probe=0, pairs=5, on_change=lambda *c: changes.append(c))
    drive(policy, per_token({2: 1.0, 1: 0.5}), 12, shape=shrinking(64))
    assert changes == [] and policy.threads == 2
    (record,) = policy.probe_log
    assert record.ended == "unlike" and record.unlike_pairs == 5
    assert record.near == pytest.approx((0.5,) * 5, rel=0.05)


def test_near_ratio_compares_decode_batches_within_an_eighth() -> None:
    """Per token, decode steps only, sizes within an eighth of the larger."""
    # The smaller of the time ratio and the per-token one, whichever batch is larger.
    assert near_ratio((StepShape(63, 63), 6.3), (StepShape(64, 64), 3.2)) == pytest.approx(
        6.3 / 3.2
    )
    assert near_ratio((StepShape(64, 64), 6.4), (StepShape(63, 63), 3.15)) == pytest.approx(2.0)
    assert near_ratio((StepShape(56, 56), 5.6), (StepShape(64, 64), 6.4)) == pytest.approx(0.875)
    assert near_ratio((StepShape(55, 55), 5.5), (StepShape(64, 64), 6.4)) is None  # 9 of 64
    assert near_ratio((StepShape(1, 40), 1.0), (StepShape(40, 40), 1.0)) is None  # a prefill
    assert near_ratio((StepShape(0, 32), 1.0), (StepShape(0, 32), 1.0)) is None  # dummy steps


def test_sim_probe_cost_compares_near_pairs_off_and_on() -> None:
    """benchmarks/sim_probe_cost.py, small: under both conditions the probes
    cost less with the near pairs, and the module's NEAR_SHAPES is put back.
    Mutation caught: the script's switch ignored (both rows the same)."""
    import sys
    from pathlib import Path

    from tracevllm.worker import cpu_threads

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import sim_probe_cost

    out = sim_probe_cost.main(["--seeds", "20", "--runs", "1"])
    for condition in ("quiet", "busy"):
        off, on = out[f"{condition}, near pairs off"], out[f"{condition}, near pairs on"]
        assert 0 < on["cost"] < off["cost"]
        assert on["other_steps_per_run"] < off["other_steps_per_run"]
    assert cpu_threads.NEAR_SHAPES == 1 / 8


def test_near_pairs_of_small_batches_do_not_stop_a_nearly_tied_probe() -> None:
    """Steps of W + C * n (a fixed part: every weight read once), batches 8, 7,
    6, ...: the other count truly 1.15x slower, inside the 1.25x margin. Per
    token, the first pair (8 at this count, 7 at the other) reads 1.15 * 8/7 *
    t(7)/t(8) = 1.27 and stopped the probe; the estimate toward a tie reads
    1.12 and does not. Mutation caught: near_ratio per token alone."""
    policy = AdaptiveThreadPolicy(2, first_probe=0, pairs=5)

    def seconds(threads: int, shape: StepShape) -> float:
        return (0.032 + 0.00125 * shape.num_tokens) * (1.15 if threads == 1 else 1.0)

    drive(policy, seconds, 2, shape=shrinking(8))
    assert policy.candidate == 1 and not policy.probe_log  # still probing


def test_a_near_pair_does_not_outvote_a_like_one() -> None:
    """A near pair reading a tie (0.7), then a like pair 1.5x slower: the like
    pair alone decides the first test, and the probe stops. Mutation caught:
    like and near ratios pooled under min() (the near pair kept it going)."""
    policy = AdaptiveThreadPolicy(2, first_probe=0, pairs=5)
    # Pair 0 runs (2, 1) on batches 8 and 7 (near); pair 1 runs (1, 2) on 7 and 7 (like).
    for shape, seconds in [(8, 1.0), (7, 0.7), (7, 1.5), (7, 1.0)]:
        policy.threads_for_step(StepShape(shape, shape))
        policy.record_step(seconds)
    (record,) = policy.probe_log
    assert record.ended == "slower" and record.ratios == (1.5,) and len(record.near) == 1


def test_a_near_pairs_slow_step_is_charged_to_the_probe_budget() -> None:
    """A probe stopped by a near pair three times slower: the next one waits so
    that probing stays within its budget (the near pair's cost counted).
    Mutation caught: only like pairs charged (the wait then just doubles)."""
    policy = AdaptiveThreadPolicy(2, first_probe=0, pairs=5, min_interval=32)
    drive(policy, per_token({2: 1.0, 1: 3.0}), 2, shape=shrinking(64))
    (near,) = policy.probe_log[-1].near
    assert policy.interval == math.ceil((near - 1) / policy.probe_budget) > 2 * 32
