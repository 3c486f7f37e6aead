"""What tracing costs on the ``make bench`` workload, counted by a sampling profiler.

On a shared 2-core machine two runs of the same engine can differ by 20 %,
so a throughput difference of a few percent between tracing levels cannot
be seen in wall time (``bench_throughput.py``'s tracing rows). This script
counts instead: it runs the workload (64 chat prompts, max_tokens 16-128,
greedy, ignore_eos; the engine core in its own process, as ``make bench``)
at each detail level in a fresh ``LLM``, and while the timed ``generate``
runs, py-spy samples every Python thread of both processes from outside
(``--nonblocking``: the engine is never paused), each thread only while it
is on a CPU or waiting for one.

A sample is tracing's from the first frame of tracing code in its stack
(``tracevllm/tracing/``, ``opentelemetry/``, or ``Attention._forward_traced``,
the attention spans' own work), with everything that code calls, until it
hands back to the engine: the method a ``tracing.instrument`` wrapper runs
inside its span, or a kernel inside the attention spans (``tracing_frame``).
So an engine method inside a span counts as the engine, the wrapper's own
work around it (making the span, its ``record``) as tracing; the batch span
processor's thread, exporting, is all tracing.

Printed for each level, against the engine core's main thread (the
critical path: it schedules, runs the forward's Python and is one of the
two compute threads):

- **engine thread**: the share of its samples that are tracing, the cost
  that lands on the critical path directly;
- **all tracing**: every tracing sample of both processes (the frontend's
  request spans, both exporters' threads) over the engine thread's
  samples. With both cores computing, a millisecond of CPU that tracing
  takes anywhere holds the forward up by about a millisecond, so this is
  about what tracing costs the throughput; less where it runs beside the
  engine on a core the engine leaves idle. What no sampler sees: a garbage
  collection the spans' allocations bring forward (it counts as whatever
  code ran then), and the model's code slowed by caches the spans evicted.

Then where the tracing samples fell (the innermost tracing frame), and the
wall-clock throughput of each run for reference. Tracing off is run as a
control: its tracing share must be about zero.

Under each of ``make bench``'s conditions (benchmarks/busy.py): quiet, and
one busy-loop process beside the engine, started before the worker starts
(so the engine's adaptive thread count meets it from the first step) and
stopped after the worker has exited. Counted shares do not drown in the
spread that a busy core gives wall time. Results go to
``benchmarks/results/tracing_cost.json``.

    make bench-tracing
    python benchmarks/bench_tracing_cost.py [--conditions quiet,busy] [--num-prompts 64]
        [--rate 100] [--rounds 1] [--details off request full] [--samples-dir DIR]
        [--output-json PATH]

Needs py-spy (``make bench-tracing`` installs it; pip install py-spy==0.4.3),
which attaches to the running worker: on Linux with Yama's ptrace_scope at 1
(Ubuntu's default) that takes root.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import busy  # benchmarks/: the quiet and busy conditions

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "tracing_cost.json")
DETAILS = ("off", "request", "full")
# py-spy writes a frame as "function (path:line)"; a prefix ending in a space
# matches one function's name and no longer one.
TRACING_FUNCTIONS = ("Attention._forward_traced ",)  # outside tracing/, the spans' own work
# Where tracing code hands back to the engine: the method a tracing wrapper
# wraps (the frame below the wrapper), and the kernels the attention spans
# are around (_kernel_frames).
WRAPPERS = ("instrument.<locals>.decorator.<locals>.wrapper ",
            "instrument.<locals>.decorator.<locals>.async_wrapper ",
            "_instrument_async_generator.<locals>.wrapper ")  # fmt: skip
# Below a wrapper, the span's own ``with`` (contextlib), not the method.
SPAN_WITH = ("_GeneratorContextManager.__enter__ ", "_GeneratorContextManager.__exit__ ")


def _tracing_dirs() -> tuple[str, ...]:
    """The source directories of tracing code: tracevllm/tracing/ and OpenTelemetry's."""
    import opentelemetry

    import tracevllm

    package = os.path.dirname(os.path.abspath(tracevllm.__file__))
    otel = tuple(os.path.abspath(p) + os.sep for p in opentelemetry.__path__)
    return (os.path.join(package, "tracing") + os.sep, *otel)


def _kernel_frames() -> tuple[str, ...]:
    """How py-spy names the two calls ``Attention._forward_traced`` makes
    inside its spans: each function's code object's qualified name, so a
    decorator's wrapper (the KV connector's ``maybe_transfer_kv_layer`` around
    the read) is named as it runs, not as the function it wraps."""
    from tracevllm.model_executor.layers import attention

    calls = (attention.unified_kv_cache_update, attention.unified_attention_with_output)
    return tuple(f"{call.__code__.co_qualname} " for call in calls)


# --- the worker: one LLM at one detail level, timed generate on cue -----------
def worker(detail: str, num_prompts: int) -> None:
    """Load, warm up, say "ready", wait for "go", generate, say "done ..."."""
    from transformers import AutoTokenizer

    from tracevllm import LLM
    from tracevllm.benchmarks.datasets import chat_samples
    from tracevllm.benchmarks.throughput import run_tracevllm
    from tracevllm.model_executor.model_loader import resolve_model

    samples = chat_samples(AutoTokenizer.from_pretrained(resolve_model(None)), num_prompts)
    with (
        tempfile.TemporaryDirectory() as d,
        LLM(trace_detail=detail, trace_dir=None if detail == "off" else d) as llm,
    ):
        run_tracevllm(llm, samples[:2], num_warmups=0, use_tqdm=False)  # warm-up
        print("ready", flush=True)
        sys.stdin.readline()
        seconds, outputs = run_tracevllm(llm, samples, num_warmups=0, use_tqdm=False)
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        print(f"done {seconds} {tokens}", flush=True)
        sys.stdin.readline()


# --- reading py-spy's samples -------------------------------------------------
@dataclass
class Count:
    """One level's samples: per thread kind, how many, how many tracing."""

    seconds: float = 0.0
    tokens: int = 0
    samples: collections.Counter[str] = field(default_factory=collections.Counter)
    tracing: collections.Counter[str] = field(default_factory=collections.Counter)
    where: collections.Counter[str] = field(default_factory=collections.Counter)


def thread_kind(frames: list[str]) -> str:
    """Which thread a stack was sampled on. py-spy puts a frame for each
    process (``process PID:"cmdline"``, the worker's, then the engine core's
    under it) and one for the thread (``thread (TID): name``) first."""
    processes = sum(frame.startswith("process ") for frame in frames)
    name = next((f.partition("): ")[2] for f in frames if f.startswith("thread (")), "")
    if name == "OtelBatchSpanRecordProcessor":  # the BatchSpanProcessor's thread
        return "exporter"
    if name == "MainThread":
        return "engine core" if processes > 1 else "frontend"
    return "other"


def tracing_frame(
    frames: list[str], tracing: tuple[str, ...], kernels: tuple[str, ...]
) -> str | None:
    """The innermost tracing frame of a sample that is tracing's, else None.

    ``tracing``: the source directories of tracing code (_tracing_dirs);
    ``kernels``: the attention spans' calls (_kernel_frames).
    Read from the outermost frame in: a sample becomes
    tracing's at the first frame of tracing code (or of TRACING_FUNCTIONS),
    and everything it calls stays tracing's (an engine helper a ``record``
    reads, json, contextlib) until it hands back to the engine: the method a
    wrapper of ``tracing.instrument`` runs (or that method's own decorator,
    torch's ``inference_mode``), or a kernel call inside
    ``Attention._forward_traced``.
    """
    where = None
    for i, frame in enumerate(frames):
        is_tracing = frame.rpartition(" (")[2].startswith(tracing) or frame.startswith(
            TRACING_FUNCTIONS
        )
        if where is not None:  # inside tracing code: does this frame hand back?
            above = frames[i - 1]
            if (
                above.startswith(WRAPPERS) and not is_tracing and not frame.startswith(SPAN_WITH)
            ) or (above.startswith(TRACING_FUNCTIONS) and frame.startswith(kernels)):
                where = None
                continue
        if is_tracing:
            where = frame
    return where


def read_samples(path: str, count: Count) -> None:
    """py-spy's raw format: one line per distinct stack, frames separated by ';'
    (outermost first, after the process and thread), then the sample count."""
    tracing, kernels = _tracing_dirs(), _kernel_frames()
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            frames = stack.split(";")
            kind = thread_kind(frames)
            count.samples[kind] += int(n)
            frame = tracing_frame(frames, tracing, kernels)
            if frame is not None:
                count.tracing[kind] += int(n)
                count.where[frame.split(" (")[0]] += int(n)


# --- one level under py-spy -----------------------------------------------------
def measure(
    condition: str, detail: str, round_: int, args: argparse.Namespace, py_spy: str, count: Count
) -> None:
    cmd = [sys.executable, __file__, "--worker", detail, "--num-prompts", str(args.num_prompts)]
    child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    spy: subprocess.Popen[str] | None = None
    try:
        line = child.stdout.readline()
        if line.strip() != "ready":
            raise SystemExit(f"the {detail} worker did not start: {line!r}")
        with tempfile.TemporaryDirectory() as d:
            raw = os.path.join(d, "samples.txt")
            spy = subprocess.Popen(
                [py_spy, "record", "--pid", str(child.pid), "--subprocesses", "--threads",
                 "--nonblocking", "--full-filenames", "--rate", str(args.rate),
                 "--format", "raw", "--output", raw],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            time.sleep(2.0)  # py-spy attaches to both processes
            if spy.poll() is not None:
                raise SystemExit(
                    f"py-spy could not attach to the worker: {spy.communicate()[1][-500:]}\n"
                    "It reads another process's memory: on Linux with Yama's ptrace_scope at 1 "
                    "(Ubuntu's default) that takes root, or "
                    "`sudo sysctl kernel.yama.ptrace_scope=0`."
                )
            child.stdin.write("go\n")
            child.stdin.flush()
            line = child.stdout.readline()
            spy.send_signal(signal.SIGINT)  # py-spy writes what it has and exits
            _, err = spy.communicate(timeout=120)
            if not line.startswith("done") or not os.path.exists(raw):
                raise SystemExit(f"the {detail} run failed: {line!r} / py-spy: {err[-500:]}")
            _, seconds, tokens = line.split()
            count.seconds += float(seconds)
            count.tokens += int(tokens)
            read_samples(raw, count)
            if args.samples_dir:  # py-spy's raw format: flamegraph.pl or speedscope read it
                os.makedirs(args.samples_dir, exist_ok=True)
                name = f"{condition}-{detail}-{round_}.txt"
                shutil.copy(raw, os.path.join(args.samples_dir, name))
        child.stdin.write("exit\n")
        child.stdin.flush()
        child.wait(timeout=120)
    finally:
        for process in (spy, child):
            if process is not None and process.poll() is None:
                process.kill()


def report(
    console: Any, condition: str, counts: dict[str, Count], args: argparse.Namespace
) -> dict[str, Any]:
    """Print one condition's tables; return its results, per detail level."""
    from rich.table import Table

    table = Table(
        title=f"What tracing costs, counted, {busy.LABELS[condition]} ({args.num_prompts} "
        f"prompts, py-spy at {args.rate}/s, {args.rounds} round(s)): tracing samples over "
        "the engine thread's"
    )
    columns = ("detail", "tok/s", "engine samples", "engine thread", "all tracing",
               "frontend", "exporters")  # fmt: skip
    for col in columns:
        table.add_column(col, justify="left" if col == "detail" else "right")
    results = {}
    for detail, c in counts.items():
        engine = c.samples["engine core"] or 1
        shares = {
            "engine thread": c.tracing["engine core"] / engine,
            "all tracing": sum(c.tracing.values()) / engine,
            "frontend": c.tracing["frontend"] / engine,
            "exporters": c.tracing["exporter"] / engine,
        }
        results[detail] = {
            "tok_s": c.tokens / c.seconds,
            **shares,
            "samples": dict(c.samples),
            "tracing": dict(c.tracing),
            "where": c.where.most_common(15),
        }
        table.add_row(
            detail,
            f"{c.tokens / c.seconds:.1f}",
            str(c.samples["engine core"]),
            *(f"{share * 100:.2f} %" for share in shares.values()),
        )
    console.print(table)
    for detail in [d for d in counts if d != "off"]:
        where = Table(
            title=f"Where {detail}'s tracing samples fall, {busy.LABELS[condition]} "
            "(innermost tracing frame)"
        )
        where.add_column("function")
        where.add_column("samples", justify="right")
        for function, n in counts[detail].where.most_common(10):
            where.add_row(function, str(n))
        console.print(where)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conditions", default="quiet,busy", help="quiet, busy or quiet,busy")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--rate", type=int, default=100, help="py-spy samples a second")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each level, summed")
    parser.add_argument("--samples-dir", help="keep py-spy's samples here (raw format)")
    parser.add_argument("--details", nargs="+", choices=DETAILS, default=list(DETAILS))
    parser.add_argument("--output-json", default=RESULTS)
    parser.add_argument("--worker", choices=DETAILS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.num_prompts)
        return
    for flag in ("num_prompts", "rate", "rounds"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    try:
        conditions = busy.parse_conditions(args.conditions)
    except ValueError as e:
        parser.error(str(e))
    py_spy = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or shutil.which("py-spy")
    if py_spy is None:
        raise SystemExit(
            "py-spy is not installed: pip install py-spy==0.4.3 (or make bench-tracing)"
        )

    from rich.console import Console

    console = Console()
    # The run's settings, without the paths (where the samples and results went).
    command = (
        f"python benchmarks/bench_tracing_cost.py --conditions {args.conditions} "
        f"--num-prompts {args.num_prompts} --rate {args.rate} --rounds {args.rounds} "
        f"--details {' '.join(args.details)}"
    )
    out: dict[str, Any] = {"command": command, "machine": busy.machine()}
    for condition in conditions:
        counts = {detail: Count() for detail in args.details}
        loads = []
        for round_ in range(args.rounds):
            for detail in args.details:
                console.print(
                    f"{busy.LABELS[condition]}, round {round_ + 1}/{args.rounds}: "
                    f"tracing {detail} ..."
                )
                with busy.under(condition) as load:
                    measure(condition, detail, round_, args, py_spy, counts[detail])
                loads.append([detail, load.start, load.end])
        out[condition] = {"results": report(console, condition, counts, args), "loads": loads}
    os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
    with open(args.output_json, "w") as f:
        json.dump(out, f, indent=1)
    console.print(f"results: {args.output_json}")


if __name__ == "__main__":
    main()
