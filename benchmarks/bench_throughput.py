"""Offline throughput: tracevllm against HF static batching and vLLM's own CPU build,
on a quiet machine and with one busy core.

The workload (issue: 64 chat prompts, per-request max_tokens drawn from 16-128
with a fixed seed, greedy, ignore_eos; only requested tokens count):
- tracevllm: one ``LLM.generate`` call over all 64 (continuous batching).
- HF: batches of 16 in order, left-padded, each generating to its longest
  request (``min_new_tokens`` = ``max_new_tokens``, so EOS cannot end it early).
- vLLM, with ``VLLM_VENV`` naming a venv that holds the real vLLM CPU build
  (``bash benchmarks/setup_vllm_venv.sh``): the same prompt token ids and
  max_tokens through vLLM's own ``LLM`` (fp32, ``VLLM_CPU_KVCACHE_SPACE=2``),
  with ``enforce_eager=True`` and then its default ``torch.compile`` path
  (benchmarks/vllm_offline.py, one process for each).

Every engine runs under each of ``--conditions`` (default both, in this
order): ``quiet``, and ``busy``: one busy-loop process (``python3 -c "while
True: pass"``, benchmarks/busy.py) started before that engine's run and
stopped after it, so every engine meets the same load. The 1-minute load
average is read as each run starts and ends and printed beside it.
tracevllm runs first and again after the others, so each condition's table
shows how far the machine moved in between (on a shared 2-core machine, runs
of the same engine differ by 10-20 %); each row's ratio is the mean of the
two tracevllm runs / that row, and each condition's summary gives tracevllm /
vLLM compiled and / vLLM eager. tracevllm's default thread count adapts while
it runs (tracevllm/worker/cpu_threads.py): each of its runs records where the
count ended and the changes on the way (``Worker.get_cpu_threads``, through
``LLM.collective_rpc``), and a third tracevllm run with the count fixed at
torch's (``TRACEVLLM_CPU_ADAPTIVE_THREADS=0``; ``--skip-fixed-threads``
leaves it out) shows what the adaptation gains in the same run.

The linear-FLOP floor (the issue's goal 3): before anything else, sgemm's
rate on this machine is measured (``torch.mm`` on fp32 squares, best of 5,
benchmarks/roofline.py's ``measure_sgemm_squares``; the best of the sizes is
the rate; measured again after the engines, and the faster of the two taken,
since a shared machine has slow minutes), and the linear layers are counted from the model's shapes
(roofline.py's ``model_shapes`` and ``step_cost``): 2 FLOP per weight per
token, every prompt token and every generated token but the last (which is
sampled and never fed back) through each layer's linears, and the LM head
once per generated token. The workload's floor is that count at the measured
rate: what the workload would take if the linears ran at sgemm's speed and
nothing else took time. Each run is measured against its own engine's floor,
which leaves out the prompt tokens that engine's prefix cache supplied (the
sum of ``num_cached_tokens`` over the timed ``RequestOutput``s: the warm-ups'
prompts come back in the timed call, and the chat prompts share their
chat-template tokens): those never run the linears. HF has no prefix cache
(its floor is the workload's; the padding and the tokens past a request's
max_tokens that its batches also compute are not counted); an engine whose
outputs do not say (``num_cached_tokens`` None) is measured against the
workload's floor, and its line says so. A run's share is its floor / its
measured seconds.

The linear floor ignores memory: a decode step of a small batch waits on
reading the weights, not on its FLOPs. The roofline floor counts both: the
memory bandwidth is measured too (a streaming read of 256 MiB,
roofline.py's ``measure_bandwidth``), and the workload is laid out in the
fewest steps it can take (every prompt in one step, then one decode step
per generated position with the requests still running), each step at
max(its FLOPs at sgemm's rate, its bytes at the read rate)
(``roofline_seconds``; attention's FLOPs and the K/V traffic counted). Each
run's share of it is printed beside its share of the linear floor.

How close the matmuls themselves can come to the linear floor is measured
too, before any engine starts (``linears_at_shapes``): the model's linears,
packed for oneDNN as the engine's, every layer its own weights (so a
forward reads them from memory, as the engine's does), timed at each step's
shape of the roofline floor's fewest steps. The linear floor over that time
is the most of the floor an engine with these matmuls could reach if nothing
else took time. ``--floors-only`` measures the floors and this, writes
them, and runs no engine (about a minute).

Then the cost of each tracing level on the same workload (or
``--tracing-prompts N`` of its kind), under each condition: off, request and
full back to back in each of ``--tracing-rounds`` rounds (default 3, the
first level rotating), each level against the same round's off, the median
of those ratios printed. The workload and the tracevllm and HF runs are
``tracevllm bench throughput``'s (tracevllm/benchmarks/). Every figure, with
the machine, the load and what it means, goes to ``--output-json``.

Run: ``make bench`` or ``VLLM_VENV=.vllm-venv make bench`` (or ``python
benchmarks/bench_throughput.py [--conditions quiet,busy] [--skip-hf]
[--skip-fixed-threads] [--skip-tracing] [--num-prompts N] [--tracing-prompts N] [--tracing-rounds N]
[--model DIR] [--output-json PATH] [--floors-only]``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, NamedTuple
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import busy  # noqa: E402
from busy import LABELS, SETTLE_S, parse_conditions, run_under, under  # noqa: E402
from offline_common import run_in_vllm_venv  # noqa: E402

# vLLM's CPU build: first without torch.compile, then its default compiled path.
VLLM_CONFIGS = [{"enforce_eager": True}, {"enforce_eager": False}]
TRACING_DETAILS = ["off", "request", "full"]
SGEMM_SIZES = (1024, 2048, 3072)
DEFAULT_JSON = os.path.join("bench-results", "bench.json")

# What each figure in the JSON is (written into it).
WHAT = {
    "sgemm": "torch.mm on fp32 n x n squares in this process, quiet, best of 5 each: "
    "squares before any engine ran, squares_after after the engines (before tracing's "
    "runs); gflops_before: the best of the sizes before (2 n^3 FLOP / seconds), gflops: "
    "the best of all, the rate every floor in this file is at",
    "floor": "the workload's linear layers at sgemm's rate, with no prefix-cache hits: "
    "linear_flops = 2 x weights x tokens (each request's prompt tokens and generated tokens "
    "but the last through every layer's linears, the LM head at each generated token; "
    "attention left out); seconds = linear_flops / (sgemm gflops x 1e9). Each run's own "
    "floor (conditions' floor_s) leaves out its cached_tokens",
    "conditions": "per condition (quiet; busy: one busy-loop process, python3 -c 'while "
    "True: pass', started before each engine run and stopped after it), each engine run: "
    "generated tokens, seconds of the timed generate (after 2 untimed warm-up requests), "
    "tok_s, the 1-minute load average as it started and ended, steal = the share of the "
    "CPUs' time the hypervisor took meanwhile (/proc/stat; another virtual machine's load); "
    "cached_tokens = the prompt "
    "tokens its prefix cache supplied in the timed generate (the sum of its RequestOutputs' "
    "num_cached_tokens; 0 for HF, which has none; null where the engine's outputs do not "
    "say), floor_s = the floor of the prompt tokens it computed (prompt tokens - "
    "cached_tokens; with null, every prompt token) and the generated ones, floor_share = "
    "floor_s / seconds. Tokens recomputed after a preemption are not counted. threads (tracevllm "
    "runs only): its worker's report after the run (Worker.get_cpu_threads): threads = the "
    "count it ended at, adaptive = whether the count adapted, changes = [old, new] in order, "
    "probes = how many probes the policy ran; key tracevllm_fixed = tracevllm with "
    "TRACEVLLM_CPU_ADAPTIVE_THREADS=0 (torch's count, fixed)",
    "bandwidth": "memory bandwidth in this process, before any engine, quiet "
    "(roofline.py's measure_bandwidth: 256 MiB fp32, best of 7): read_gbps = a streaming "
    "read (sum), copy_gbps = a copy, read and write counted",
    "linears_at_shapes": "the workload's linears in the roofline floor's fewest steps, each "
    "step's timed at its own shape (roofline.py's linears_seconds: the step's rows through "
    "every layer's four linears in turn, each layer its own weights as in the model, so "
    "they come from memory, then its logits rows through the LM head; packed for oneDNN "
    "as the engine's, random weights and inputs, best of 3, this process's threads, quiet, "
    "before any engine ran): seconds, and floor_share_ceiling = floor seconds / these "
    "seconds, the most of the linear floor an engine with these matmuls can reach if "
    "nothing else took time (its floor at the final sgemm rate, its seconds timed before "
    "the engines: the two may come from different spells of a shared machine)",
    "roofline_floor": "the workload in the fewest steps (every prompt in one step, then "
    "one decode step per generated position with the requests still running), each step "
    "at max(its FLOPs at sgemm's gflops, its bytes at bandwidth read_gbps) "
    "(roofline.py's step_cost: linears, LM head and attention; weights read once a step, "
    "K/V read and written); conditions' roofline_s leaves out each run's cached_tokens "
    "from the prompt step, roofline_share = roofline_s / seconds, summary roofline_share = "
    "the mean of tracevllm's two runs'",
    "summary": "per condition: tracevllm_tok_s = the mean of its two runs (first and after "
    "the others); ratio_vs_X = tracevllm_tok_s / X's tok/s (ratio_vs_tracevllm_fixed: what "
    "the adaptive thread count gains over the fixed one); floor_share = the mean of "
    "tracevllm's two runs' floor shares (each against its own floor_s), floor_s = the mean "
    "of their floor_s",
    "tracing": "per condition: tok/s of tracing off, request and full detail, back to back "
    "in each round (first level rotating), each in a fresh LLM; vs_off = the median over "
    "rounds of (level / the same round's off) - 1; threads: each run's worker thread "
    "report after it (Worker.get_cpu_threads)",
}


@dataclass
class Run:
    """One measured engine run under one condition."""

    engine: str  # the row's name
    key: str  # tracevllm | hf | vllm_eager | vllm_compiled
    tokens: int
    seconds: float
    load_start: float
    load_end: float
    floor_share: float | None = None
    cached_tokens: int | None = None  # prompt tokens from the prefix cache; None: not said
    floor_s: float | None = None  # this run's floor: the tokens it computed
    # tracevllm's worker after the run (Worker.get_cpu_threads): its count,
    # whether it adapted, the changes made; None for the other engines.
    threads: dict[str, Any] | None = None
    roofline_s: float | None = None  # this run's roofline floor (its cached tokens out)
    steal: float | None = None  # the share of CPU time the hypervisor took (busy.Load)

    @property
    def roofline_share(self) -> float | None:
        return None if self.roofline_s is None else self.roofline_s / self.seconds

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


# --------------------------------------------------------------- pure pieces
def linear_flops(
    m: dict[str, Any], requests: Sequence[tuple[int, int]], cached_tokens: int = 0
) -> float:
    """The linear layers' FLOPs of ``(prompt tokens, generated tokens)`` requests
    (``m``: roofline.model_shapes): through every layer, each prompt token and
    each generated token but the last; through the LM head, each generated one.
    ``cached_tokens`` prompt tokens, supplied by a prefix cache, run no layer."""
    from roofline import step_cost

    total = 0.0
    for prompt, generated in requests:
        total += step_cost(m, prompt + generated - 1, generated, 0, 0)[0]
    return total - step_cost(m, cached_tokens, 0, 0, 0)[0]


# --8<-- [start:roofline_seconds]
class Step(NamedTuple):
    rows: int  # tokens through every layer's linears
    logits: int  # rows through the LM head
    pairs: int  # (query, key) pairs of attention
    ctx: int  # tokens of K/V read


def fewest_steps(requests: Sequence[tuple[int, int]], cached_tokens: int = 0) -> Iterator[Step]:
    """The workload of ``(prompt tokens, generated tokens)`` requests in the
    fewest steps it can run in: every prompt in one step (less
    ``cached_tokens`` from a prefix cache; a logits row a request), then one
    decode step per generated position with the requests still running:
    request i takes part in decode steps 1 to generated_i - 1."""
    prompts = sum(p for p, _ in requests)
    pairs = sum(p * (p + 1) // 2 for p, _ in requests)
    yield Step(prompts - cached_tokens, len(requests), pairs, 0)
    for k in range(1, max((g for _, g in requests), default=0)):
        running = [p + k for p, g in requests if g > k]
        ctx = sum(running)
        yield Step(len(running), len(running), ctx, ctx)


def roofline_seconds(
    m: dict[str, Any],
    requests: Sequence[tuple[int, int]],
    gflops: float,
    gbps: float,
    cached_tokens: int = 0,
) -> float:
    """The workload's roofline floor: its fewest steps, each at max(its FLOPs
    at ``gflops``, its bytes at ``gbps``) (roofline.step_cost: linears, LM head
    and attention; the weights read once a step, K/V read and written).
    Unlike the linear floor, a step cannot beat reading the weights, which is
    what a small decode batch waits on."""
    from roofline import step_cost

    def step_s(flops: float, nbytes: float) -> float:
        return max(flops / (gflops * 1e9), nbytes / (gbps * 1e9))

    return sum(step_s(*step_cost(m, *step)) for step in fewest_steps(requests, cached_tokens))


# --8<-- [end:roofline_seconds]


# --8<-- [start:linears_at_shapes]
def linears_at_shapes(
    requests: Sequence[tuple[int, int]],
    time_linears: Callable[[int, int], float],
    cached_tokens: int = 0,
) -> float:
    """The workload's linears in its fewest steps, each step's at the speed
    ``time_linears(rows, logits_rows)`` measures for that step's shape: the
    same FLOPs as ``linear_flops``, at their own shapes instead of sgemm's
    best. A shape that comes again is timed once."""
    seconds: dict[tuple[int, int], float] = {}
    total = 0.0
    for step in fewest_steps(requests, cached_tokens):
        shape = (step.rows, step.logits)
        if shape not in seconds:
            seconds[shape] = time_linears(*shape)
        total += seconds[shape]
    return total


# --8<-- [end:linears_at_shapes]


def floor_seconds(flops: float, gflops: float) -> float:
    """What ``flops`` take at ``gflops`` GFLOP/s."""
    return flops / (gflops * 1e9)


def run_conditions(
    conditions: Sequence[str],
    engines: Sequence[tuple[str, str, Callable[[], tuple[Any, ...]]]],
    floor: Callable[[int | None], float] | None = None,
    report: Callable[[str, Run], None] | None = None,
    settle_s: float = SETTLE_S,
    roofline: Callable[[int | None], float] | None = None,
) -> dict[str, list[Run]]:
    """Each ``(name, key, run)`` of ``engines`` in turn under each condition
    (``run()`` -> (seconds, tokens, prompt tokens from its prefix cache or
    None[, tracevllm's thread report])); each run's floor is ``floor(those
    cached tokens)``. The busy loop,
    if any, lives exactly as long as one ``run()``."""
    keys = {name: key for name, key, _ in engines}
    out: dict[str, list[Run]] = {c: [] for c in conditions}
    jobs = [(name, run) for name, _, run in engines]
    for condition, name, result, load in run_under(conditions, jobs, settle_s):
        seconds, tokens, cached = result[:3]
        floor_s = floor(cached) if floor is not None else None
        share = floor_s / seconds if floor_s is not None else None
        threads = result[3] if len(result) > 3 else None
        roofline_s = roofline(cached) if roofline is not None else None
        out[condition].append(Run(name, keys[name], tokens, seconds, load.start, load.end,
                                  share, cached, floor_s, threads=threads,
                                  roofline_s=roofline_s, steal=load.steal))  # fmt: skip
        if report:
            report(condition, out[condition][-1])
    return out


def rescore(
    run: Run, floor: Callable[[int | None], float], roofline: Callable[[int | None], float]
) -> Run:
    """``run`` against floors at another sgemm rate: its floor, share and roofline again."""
    floor_s = floor(run.cached_tokens)
    return replace(
        run,
        floor_s=floor_s,
        floor_share=floor_s / run.seconds,
        roofline_s=roofline(run.cached_tokens),
    )


def summarize(runs: Sequence[Run]) -> dict[str, Any]:
    """tracevllm's mean tok/s over its runs, each other engine's, and the ratios."""
    ours = [r for r in runs if r.key == "tracevllm"]
    summary: dict[str, Any] = {"tracevllm_tok_s": statistics.mean(r.tok_s for r in ours)}
    shares = [r.floor_share for r in ours if r.floor_share is not None]
    summary["floor_share"] = statistics.mean(shares) if shares else None
    floors = [r.floor_s for r in ours if r.floor_s is not None]
    summary["floor_s"] = statistics.mean(floors) if floors else None
    rooflines = [r for r in ours if r.roofline_s is not None]
    summary["roofline_share"] = (
        statistics.mean(r.roofline_s / r.seconds for r in rooflines) if rooflines else None  # type: ignore[operator]
    )
    for r in runs:
        if r.key != "tracevllm":
            summary[f"{r.key}_tok_s"] = r.tok_s
            summary[f"ratio_vs_{r.key}"] = summary["tracevllm_tok_s"] / r.tok_s
    return summary


def tracing_cost(rates: dict[str, list[float]]) -> dict[str, float]:
    """Each level but off: the median over rounds of (its tok/s / that round's off) - 1."""
    return {
        detail: statistics.median(r / off for r, off in zip(runs, rates["off"], strict=True)) - 1
        for detail, runs in rates.items()
        if detail != "off"
    }


def tracing_order(round_: int) -> list[str]:
    """The levels of round ``round_``, the first one rotating."""
    first = round_ % len(TRACING_DETAILS)
    return TRACING_DETAILS[first:] + TRACING_DETAILS[:first]


# --------------------------------------------------------------- measuring
def bench_tracevllm(
    samples: list[Any], env: dict[str, str] | None = None, **llm_kwargs: Any
) -> tuple[float, int, int, dict[str, Any]]:
    """(seconds, generated tokens, prompt tokens its prefix cache supplied) of
    the timed ``generate``, and its worker's thread report after it
    (``Worker.get_cpu_threads``). ``env``: set while the engine starts."""
    from tracevllm import LLM
    from tracevllm.benchmarks.throughput import run_tracevllm

    # patch.dict: the variables set while the engine starts (its process
    # inherits them), os.environ as it was after.
    with mock.patch.dict(os.environ, env or {}), LLM(**llm_kwargs) as llm:
        elapsed, outs = run_tracevllm(llm, samples, num_warmups=2, use_tqdm=False)
        (threads,) = llm.collective_rpc("get_cpu_threads")
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    asked = sum(s.expected_output_len for s in samples)
    assert generated == asked, (generated, asked)
    return elapsed, generated, sum(o.num_cached_tokens for o in outs), threads


def alternate_engines(
    samples: list[Any], threads: int, rounds: int, variants: dict[str, dict[str, Any]]
) -> dict[str, list[float]]:
    """tok/s of each variant (its ``LLM`` keyword arguments), alternating,
    ``rounds`` runs each, every run a fresh engine at ``threads`` threads
    (``TRACEVLLM_NUM_THREADS``); each run's line printed as it ends."""
    rates: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, llm_kwargs in variants.items():
            env = {"TRACEVLLM_NUM_THREADS": str(threads)}
            seconds, generated, _, _ = bench_tracevllm(samples, env=env, **llm_kwargs)
            rates[name].append(generated / seconds)
            print(f"engine, {threads} thread(s), {name}: {rates[name][-1]:.1f} tok/s", flush=True)
    return rates


def bench_vllm(venv: str, model_dir: str, samples: list[Any], config: dict[str, Any]) -> dict:
    """The same prompt token ids and max_tokens through vLLM's LLM (another process)."""
    job = {
        "model": model_dir,
        "prompts": [s.prompt_token_ids for s in samples],
        "max_tokens": [s.expected_output_len for s in samples],
        "num_warmups": 2,
        "configs": [config],
    }
    result: dict[str, Any] = run_in_vllm_venv(venv, "vllm_offline.py", job)[0]
    return result


def machine() -> dict[str, Any]:
    import torch

    return {**busy.machine(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__}


def _fmt_cached(run: Run) -> str:
    if run.cached_tokens is None:
        return "prefix-cache hits not reported: floor counts every prompt token"
    return f"{run.cached_tokens} prompt tokens from the prefix cache"


def thread_path(report: dict[str, Any]) -> str:
    """Where a worker's thread count went: "2", or "2 -> 1" after a change."""
    counts = [c[0] for c in report["changes"]] + [report["threads"]]
    return " -> ".join(map(str, counts))


def _fmt_threads(report: dict[str, Any] | None) -> str:
    if report is None:
        return ""
    if not report["adaptive"]:
        return f", {report['threads']} threads (fixed)"
    probes = f"{report['probes']} probe{'s' * (report['probes'] != 1)}"
    return f", threads {thread_path(report)} (adaptive, {probes})"


def _fmt_run(condition: str, run: Run) -> str:
    share = ""
    if run.floor_share is not None and run.floor_s is not None:
        share = (f", {run.floor_share * 100:.0f}% of its floor {run.floor_s:.2f} s "
                 f"({_fmt_cached(run)})")  # fmt: skip
    return (
        f"  {LABELS[condition]:<13} {run.engine}: {run.tokens} tokens in {run.seconds:.1f} s = "
        f"{run.tok_s:.1f} tok/s{share}{_fmt_threads(run.threads)}, "
        f"load {run.load_start:.2f}->{run.load_end:.2f}{busy.fmt_steal(run.steal or 0.0)}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conditions", default="quiet,busy", help="quiet, busy or both")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument(
        "--skip-fixed-threads",
        action="store_true",
        help="leave out the run with the thread count fixed (adaptive off)",
    )
    parser.add_argument("--skip-tracing", action="store_true")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--tracing-prompts", type=int, help="default: --num-prompts")
    parser.add_argument("--tracing-rounds", type=int, default=3)
    parser.add_argument("--model", default=None, help="model directory (default: the default)")
    parser.add_argument(
        "--sgemm-sizes", default=",".join(map(str, SGEMM_SIZES)), help="the squares' n"
    )
    parser.add_argument("--output-json", default=DEFAULT_JSON, help="write every figure here")
    parser.add_argument(
        "--floors-only",
        action="store_true",
        help="measure the floors and the linears' ceiling, write them, run no engine",
    )
    args = parser.parse_args(argv)
    if args.tracing_prompts is None:
        args.tracing_prompts = args.num_prompts
    for flag in ("num_prompts", "tracing_prompts", "tracing_rounds"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    try:
        conditions = parse_conditions(args.conditions)
    except ValueError as e:
        parser.error(str(e))
    from rich.console import Console
    from rich.table import Table
    from roofline import (
        linears_seconds,
        measure_bandwidth,
        measure_sgemm_squares,
        model_shapes,
        packed_linears,
    )
    from transformers import AutoTokenizer

    from tracevllm.benchmarks.datasets import chat_samples
    from tracevllm.benchmarks.throughput import run_hf
    from tracevllm.model_executor.model_loader import resolve_model

    console = Console(width=None if sys.stdout.isatty() else 160)
    model_dir = resolve_model(args.model)
    res: dict[str, Any] = {"what": WHAT, "machine": machine(), "args": vars(args)}
    res["command"] = "python benchmarks/bench_throughput.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    console.print(
        f"{res['machine']['cpu']}, {res['machine']['cores']} cores, torch "
        f"{res['machine']['torch_threads']} threads, load "
        + " ".join(f"{x:.2f}" for x in res["machine"]["load_average_at_start"])
    )
    console.print("sgemm on this machine (quiet, before any engine):")
    squares = measure_sgemm_squares(tuple(int(n) for n in args.sgemm_sizes.split(",")))
    gflops = max(s["gflops"] for s in squares)
    res["sgemm"] = {"squares": squares, "gflops": gflops}
    console.print("memory bandwidth (quiet, before any engine):")
    res["bandwidth"] = measure_bandwidth()
    gbps = res["bandwidth"]["read_gbps"]

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    samples = chat_samples(tokenizer, args.num_prompts)
    asked = sum(s.expected_output_len for s in samples)
    shapes = model_shapes(args.model)
    requests = [(len(s.prompt_token_ids), s.expected_output_len) for s in samples]
    flops = linear_flops(shapes, requests)
    floor_s = floor_seconds(flops, gflops)
    # The rate the floors use: sgemm's best so far (measured again after the engines).
    rate = {"gflops": gflops}

    def floor(cached: int | None) -> float:
        """A run's floor: the prompt tokens its prefix cache did not supply (all
        of them where the engine does not say) and the generated ones."""
        return floor_seconds(linear_flops(shapes, requests, cached or 0), rate["gflops"])

    def roofline(cached: int | None) -> float:
        """A run's roofline floor, its prefix-cache hits left out as for ``floor``."""
        return roofline_seconds(shapes, requests, rate["gflops"], gbps, cached or 0)

    res["model"] = {"name": shapes["name"], "linear_params": shapes["linear_params"],
                    "lm_head_params": shapes["lm_head_params"]}  # fmt: skip
    res["workload"] = {
        "num_prompts": len(samples),
        "prompt_tokens": sum(len(s.prompt_token_ids) for s in samples),
        "requested_tokens": asked,
        "requests": [list(r) for r in requests],  # (prompt tokens, max_tokens) each
    }
    res["floor"] = {"linear_flops": flops, "seconds": floor_s}
    res["roofline_floor"] = {"seconds": roofline(0), "read_gbps": gbps}
    console.print("the model's linears at the workload's shapes (quiet, before any engine):")
    linears = packed_linears(shapes)  # the model's weight bytes again
    at_shapes = linears_at_shapes(requests, functools.partial(linears_seconds, linears))
    del linears  # the engines run in processes of their own
    res["linears_at_shapes"] = {"seconds": at_shapes, "floor_share_ceiling": floor_s / at_shapes}
    console.print(
        f"workload: {len(samples)} chat prompts ({res['workload']['prompt_tokens']} prompt "
        f"tokens), max_tokens 16-128 (seed 0), {asked} requested tokens, greedy, ignore_eos, "
        f"fp32; conditions: {', '.join(LABELS[c] for c in conditions)}\n"
        f"linear-FLOP floor: {flops / 1e9:.1f} GFLOP at the measured sgemm {gflops:.1f} "
        f"GFLOP/s = {floor_s:.2f} s with no prefix-cache hits; each run's floor leaves out "
        f"the prompt tokens its engine's prefix cache supplied\n"
        f"roofline floor: {res['roofline_floor']['seconds']:.2f} s (every prompt in one step, "
        f"then a decode step per generated position, each at max(FLOPs at sgemm's rate, "
        f"bytes at the streaming read's {gbps:.1f} GB/s))\n"
        f"the same linears at their own shapes (packed oneDNN fp32, each step's batch): "
        f"{at_shapes:.2f} s, so an engine with these matmuls and nothing else reaches at "
        f"most {floor_s / at_shapes * 100:.0f}% of the linear floor"
    )
    if args.floors_only:
        write_json(res, args.output_json)
        console.print(f"wrote {args.output_json} (--floors-only: no engine ran)")
        return

    llm_kwargs = {"model": model_dir}
    engines: list[tuple[str, str, Callable[[], tuple[Any, ...]]]] = [
        ("tracevllm, first run", "tracevllm", lambda: bench_tracevllm(samples, **llm_kwargs))
    ]
    if not args.skip_fixed_threads:
        # The same engine with its thread count fixed where the adaptive one
        # starts (torch's, or what TRACEVLLM_NUM_THREADS / _RESERVED_CPU say,
        # which also turn the adaptation off): what adapting gains, in this run.
        fixed = {"TRACEVLLM_CPU_ADAPTIVE_THREADS": "0"}
        engines.append(("tracevllm, thread count fixed (TRACEVLLM_CPU_ADAPTIVE_THREADS=0)",
                        "tracevllm_fixed",
                        lambda: bench_tracevllm(samples, fixed, **llm_kwargs)))  # fmt: skip
    if not args.skip_hf:
        engines.append(("HF transformers (static batches of 16)", "hf",
                        lambda: (run_hf(model_dir, samples), asked, 0)))  # fmt: skip
    venv = os.environ.get("VLLM_VENV")
    if venv:
        for config in VLLM_CONFIGS:
            mode = "enforce_eager" if config["enforce_eager"] else "torch.compile"
            key = "vllm_eager" if config["enforce_eager"] else "vllm_compiled"

            def run_vllm(config: dict[str, Any] = config) -> tuple[float, int, int | None]:
                result = bench_vllm(venv, model_dir, samples, config)
                return result["seconds"], result["tokens"], result.get("cached_tokens")

            engines.append((f"vLLM 0.32 CPU ({mode})", key, run_vllm))
    # tracevllm again, after the others: how far the machine moved meanwhile.
    engines.append(("tracevllm, second run (after the others)", "tracevllm", engines[0][2]))
    console.print("measuring (each run under its condition):")
    by_condition = run_conditions(
        conditions, engines, floor, lambda c, r: console.print(_fmt_run(c, r)), roofline=roofline
    )
    # sgemm once more, quiet, after the engines: a machine shared with others
    # has slow minutes, and a rate measured in one would flatter every share
    # (one run measured 153 GFLOP/s first, where the model's own linears then
    # ran at 176). The floors take the faster of the two.
    console.print("sgemm again (quiet, after the engines):")
    after = measure_sgemm_squares(tuple(int(n) for n in args.sgemm_sizes.split(",")))
    res["sgemm"] |= {"squares_after": after, "gflops_before": gflops}
    gflops_after = max(s["gflops"] for s in after)
    if gflops_after > gflops:
        rate["gflops"] = res["sgemm"]["gflops"] = gflops_after
        floor_s = floor_seconds(flops, rate["gflops"])
        res["floor"]["seconds"] = floor_s
        res["roofline_floor"]["seconds"] = roofline(0)
        res["linears_at_shapes"]["floor_share_ceiling"] = floor_s / at_shapes
        by_condition = {c: [rescore(r, floor, roofline) for r in runs]
                        for c, runs in by_condition.items()}  # fmt: skip
        console.print(
            f"faster than before the engines ({gflops:.1f} GFLOP/s): the floors below are at "
            f"{rate['gflops']:.1f} GFLOP/s, {floor_s:.2f} s with no prefix-cache hits (the "
            f"shares printed with each run above were at the slower rate); the matmuls' "
            f"ceiling {floor_s / at_shapes * 100:.0f}%"
        )
    res["conditions"] = {}
    for condition, runs in by_condition.items():
        summary = summarize(runs)
        res["conditions"][condition] = {"runs": [asdict(r) | {"tok_s": r.tok_s} for r in runs],
                                        "summary": summary}  # fmt: skip
        ours = summary["tracevllm_tok_s"]
        table = Table(title=f"Offline throughput (generated tokens / s), {LABELS[condition]}")
        for col in ("engine", "tokens", "seconds", "tok/s", "load start->end",
                    "prefix-cache hits", "its floor", "share of floor",
                    "share of roofline floor", "tracevllm (mean of 2) / this"):  # fmt: skip
            table.add_column(col, justify="right" if col != "engine" else "left")
        for r in runs:
            table.add_row(r.engine, str(r.tokens), f"{r.seconds:.1f}", f"{r.tok_s:.1f}",
                          f"{r.load_start:.2f}->{r.load_end:.2f}",
                          "not reported" if r.cached_tokens is None else str(r.cached_tokens),
                          f"{r.floor_s:.2f} s" if r.floor_s is not None else "",
                          f"{r.floor_share * 100:.0f}%" if r.floor_share is not None else "",
                          f"{r.roofline_share * 100:.0f}%" if r.roofline_share is not None else "",
                          f"{ours / r.tok_s:.2f}x")  # fmt: skip
        console.print(table)
    summary_table = Table(title="tracevllm against vLLM, by condition (one run, this machine)")
    for col in ("condition", "tracevllm tok/s", "/ vLLM compiled", "/ vLLM eager",
                "/ its threads fixed", "share of floor", "of roofline floor"):  # fmt: skip
        summary_table.add_column(col, justify="right" if col != "condition" else "left")
    for condition in conditions:
        s = res["conditions"][condition]["summary"]
        summary_table.add_row(
            LABELS[condition],
            f"{s['tracevllm_tok_s']:.1f}",
            f"{s['ratio_vs_vllm_compiled']:.2f}x" if "ratio_vs_vllm_compiled" in s else "-",
            f"{s['ratio_vs_vllm_eager']:.2f}x" if "ratio_vs_vllm_eager" in s else "-",
            f"{s['ratio_vs_tracevllm_fixed']:.2f}x" if "ratio_vs_tracevllm_fixed" in s else "-",
            f"{s['floor_share'] * 100:.0f}% of {s['floor_s']:.2f} s",
            f"{s['roofline_share'] * 100:.0f}%" if s["roofline_share"] is not None else "-",
        )
    console.print(summary_table)
    if not venv:
        console.print("(VLLM_VENV not set: vLLM's CPU build not measured)")

    if not args.skip_tracing:
        res["tracing"] = measure_tracing(args, conditions, tokenizer, llm_kwargs, console)
    write_json(res, args.output_json)
    console.print(f"wrote {args.output_json}")


def measure_tracing(
    args: argparse.Namespace,
    conditions: list[str],
    tokenizer: Any,
    llm_kwargs: dict[str, Any],
    console: Any,
    settle_s: float = SETTLE_S,
) -> dict[str, Any]:
    """Tracing cost under each condition: each level in a fresh LLM, the three
    back to back in each round, the first rotating round by round; each level is
    compared with tracing off *of the same round*, and the median of those ratios
    is printed: a change in the machine's speed between rounds (10-20 % here)
    then cancels out."""
    from rich.table import Table

    from tracevllm.benchmarks.datasets import chat_samples

    samples = chat_samples(tokenizer, args.tracing_prompts)
    out: dict[str, Any] = {"prompts": len(samples), "rounds": args.tracing_rounds}
    for condition in conditions:
        rates: dict[str, list[float]] = {d: [] for d in TRACING_DETAILS}
        loads: dict[str, list[list[float]]] = {d: [] for d in TRACING_DETAILS}
        # Each run's thread count: a run that stayed at every core beside the
        # busy process shows as a slow level, whatever tracing costs.
        threads: dict[str, list[dict[str, Any]]] = {d: [] for d in TRACING_DETAILS}
        for round_ in range(args.tracing_rounds):
            for detail in tracing_order(round_):
                with tempfile.TemporaryDirectory() as d, under(condition, settle_s) as load:
                    t, n, _, report = bench_tracevllm(samples, trace_detail=detail,
                                                      trace_dir=None if detail == "off" else d,
                                                      **llm_kwargs)  # fmt: skip
                rates[detail].append(n / t)
                loads[detail].append([load.start, load.end])
                threads[detail].append(report)
                console.print(
                    f"  {LABELS[condition]:<13} tracing {detail:<8} round {round_ + 1}: "
                    f"{n / t:.1f} tok/s, {load}{_fmt_threads(report)}"
                )
        vs_off = tracing_cost(rates)
        out[condition] = {
            "tok_s": rates,
            "load_start_end": loads,
            "threads": threads,
            "vs_off": vs_off,
        }
        cost = Table(
            title=f"Tracing cost, {LABELS[condition]} ({len(samples)} prompts, "
            f"{args.tracing_rounds} rounds, vs off: median of each round's ratio)"
        )
        for col in ("detail", "median tok/s", "runs", "load start->end", "vs off"):
            cost.add_column(col, justify="right" if col != "detail" else "left")
        for detail, runs in rates.items():
            cost.add_row(
                detail,
                f"{statistics.median(runs):.1f}",
                " ".join(f"{r:.0f}" for r in runs),
                " ".join(f"{a:.2f}->{b:.2f}" for a, b in loads[detail]),
                "" if detail == "off" else f"{vs_off[detail] * 100:+.1f}%",
            )
        console.print(cost)
    return out


def write_json(res: dict[str, Any], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
