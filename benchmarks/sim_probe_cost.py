"""What the adaptive thread count's probes cost on make bench's workload, simulated.

The policy (tracevllm/worker/cpu_threads.py, ``AdaptiveThreadPolicy``) is
pure bookkeeping, so it can be driven by made-up step times: here those of
``make bench``'s workload in the fewest steps it runs in (every prompt in one
step, then one decode step per generated position with the requests still
running: bench_throughput's ``fewest_steps`` over the workload recorded in a
``make bench`` JSON), ``--runs`` runs back to back in one engine, each with
``--seeds`` different noise. A decode step of ``n`` requests at the count
that wins takes ``W + C * n`` (W = 32 ms, C = 1.25 ms: profile_step.py's
two-thread decode steps, 33 ms at batch 1 and 112 ms at 64), times a noise of
5% (log-normal). The other count:

- quiet: one thread, 1.8 times as long (the probes' ratios in make bench's
  runs: 1.58 to 2.08);
- one busy core: two threads, 1 to 4 times as long, drawn step by step (a
  descheduled thread stalls a step or not; the probes' ratios: 0.33 to 0.88
  the other way).

Each run starts where the warm-up probe leaves it (quiet two threads, busy
one). A probe's cost is the time its steps at the other count took beyond
what they would have at the kept one, as a share of the whole. Both with the
near pairs (two decode batches within an eighth compared per token, for the
test that stops a slower probe: ``near_ratio``) and without
(``NEAR_SHAPES = 0``: like shapes only).

    python benchmarks/sim_probe_cost.py [--runs 3] [--seeds 200] [--workload F]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

DEFAULT_WORKLOAD = os.path.join(ROOT, "benchmarks", "results", "bench-prefill-kernel.json")
W_S, C_S = 0.032, 0.00125  # a decode step of n requests: W + C * n seconds
PREFILL_S = 2.0  # the prompts' step
NOISE = 0.05
QUIET_OTHER = 1.8  # one thread against two, quiet
BUSY_OTHER = (1.0, 4.0)  # two threads against one beside a busy core: drawn in this range


def simulate(
    requests: list[tuple[int, int]], condition: str, near: bool, runs: int, seed: int
) -> dict[str, float]:
    """The probes' cost over ``runs`` runs of the workload in one engine."""
    from bench_throughput import fewest_steps

    from tracevllm.worker import cpu_threads
    from tracevllm.worker.cpu_threads import AdaptiveThreadPolicy, StepShape

    rng = random.Random(seed)
    kept = 2 if condition == "quiet" else 1
    policy = AdaptiveThreadPolicy(2)
    policy.threads = kept  # where the warm-up probe left it
    policy.steps_to_probe = policy.interval = 2 * policy.min_interval
    saved = cpu_threads.NEAR_SHAPES
    cpu_threads.NEAR_SHAPES = saved if near else 0.0
    total = extra = 0.0
    other_steps = 0
    try:
        for _ in range(runs):
            for step in fewest_steps(requests):
                shape = StepShape(num_reqs=step.logits, num_tokens=step.rows)
                decode = step.logits == step.rows
                best = W_S + C_S * step.rows if decode else PREFILL_S
                best *= rng.lognormvariate(0, NOISE)
                threads = policy.threads_for_step(shape)
                if threads == kept:
                    seconds = best
                else:
                    other_steps += 1
                    slower = QUIET_OTHER if condition == "quiet" else rng.uniform(*BUSY_OTHER)
                    seconds = best * slower
                policy.record_step(seconds)
                total += seconds
                extra += seconds - best
    finally:
        cpu_threads.NEAR_SHAPES = saved
    return {"cost": extra / total, "other_steps_per_run": other_steps / runs}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs back to back in one engine")
    parser.add_argument("--seeds", type=int, default=200)
    parser.add_argument("--workload", default=DEFAULT_WORKLOAD, help="a make bench JSON")
    args = parser.parse_args(argv)
    with open(args.workload) as f:
        requests = [tuple(r) for r in json.load(f)["workload"]["requests"]]
    out: dict[str, Any] = {}
    print(f"{len(requests)} requests, {args.runs} runs each, {args.seeds} seeds:")
    for condition in ("quiet", "busy"):
        for near in (False, True):
            sims = [simulate(requests, condition, near, args.runs, s) for s in range(args.seeds)]
            row = {k: statistics.mean(s[k] for s in sims) for k in sims[0]}
            out[f"{condition}, near pairs {'on' if near else 'off'}"] = row
            print(
                f"  {condition:5s} near pairs {'on ' if near else 'off'}: the probes cost "
                f"{row['cost'] * 100:.2f}% of the runs' time, "
                f"{row['other_steps_per_run']:.1f} steps a run at the other count"
            )
    return out


if __name__ == "__main__":
    main()
