"""The engine's CPU thread count on a quiet machine and beside one busy process.

Runs ``make bench``'s offline workload (chat prompts, max_tokens 16-128
seeded, greedy, ignore_eos, fp32; ``--num-prompts``, default 16 here) through
tracevllm's ``LLM`` in three thread settings:

- ``TRACEVLLM_NUM_THREADS=<all>``: every core to OpenMP (the old default);
- ``TRACEVLLM_CPU_NUM_OF_RESERVED_CPU=1``: one core left over (vLLM's default);
- nothing set: the adaptive count (tracevllm/worker/cpu_threads.py).

each both quiet and with one busy-loop process (``python3 -c "while True:
pass"``) running beside the engine, all interleaved in one run (the order
rotates round by round), each in a fresh process. "Quiet" is only as quiet as
the machine is: the 1-minute load average is read as each run starts and
ends and printed with it; compare rows within one run. While each run goes,
the machine's run queue (``/proc/stat``'s ``procs_running``) is sampled
every 20 ms and its mean printed, and the adaptive runs' thread changes
(the engine's ``CPU threads: a -> b`` log lines) are counted.

Run: ``make bench-threads`` (``ARGS="--num-prompts 64 --rounds 2"`` for the
full workload), or ``python benchmarks/bench_threads.py [--num-prompts N]
[--rounds N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from busy import RunQueueSampler, parse_conditions, under  # noqa: E402


def settings(cores: int) -> dict[str, tuple[str, dict[str, str]]]:
    """``--settings`` key -> (the row's name, the environment it runs with)."""
    return {
        "all": (
            f"fixed {cores} threads (TRACEVLLM_NUM_THREADS={cores})",
            {"TRACEVLLM_NUM_THREADS": str(cores)},
        ),
        "reserve1": (
            "reserve 1 CPU (TRACEVLLM_CPU_NUM_OF_RESERVED_CPU=1)",
            {"TRACEVLLM_CPU_NUM_OF_RESERVED_CPU": "1"},
        ),
        "adaptive": ("adaptive (default)", {}),
    }


@dataclass
class Run:
    tok_s: float
    load_start: float
    load_end: float
    runqueue: float
    changes: list[str] = field(default_factory=list)


def child(num_prompts: int, num_warmups: int) -> None:
    """One measurement, in this process: print its JSON on the last line."""
    from transformers import AutoTokenizer

    from tracevllm import LLM
    from tracevllm.benchmarks.datasets import chat_samples
    from tracevllm.benchmarks.throughput import run_tracevllm
    from tracevllm.model_executor.model_loader import resolve_model

    model_dir = resolve_model(None)
    samples = chat_samples(AutoTokenizer.from_pretrained(model_dir), num_prompts)
    with LLM() as llm:
        elapsed, outs = run_tracevllm(llm, samples, num_warmups=num_warmups, use_tqdm=False)
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    print(json.dumps({"tokens": generated, "seconds": elapsed}))


def measure(env_overrides: dict[str, str], busy: bool, args: argparse.Namespace) -> Run:
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "TRACEVLLM_NUM_THREADS",
            "TRACEVLLM_CPU_NUM_OF_RESERVED_CPU",
            "TRACEVLLM_CPU_ADAPTIVE_THREADS",
        )
    }
    # The engine process's "CPU threads: a -> b" lines are INFO (tracevllm/logger.py).
    env |= env_overrides | {"TRACEVLLM_LOGGING_LEVEL": "INFO", "TRACEVLLM_CONFIGURE_LOGGING": "1"}
    cmd = [sys.executable, os.path.abspath(__file__), "--child"]
    cmd += ["--num-prompts", str(args.num_prompts), "--num-warmups", str(args.num_warmups)]
    with under("busy" if busy else "quiet") as load, RunQueueSampler() as queue:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        sys.stderr.write(out.stdout + out.stderr)
        raise SystemExit(f"run failed ({out.returncode}): {env_overrides}, busy={busy}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    changes = re.findall(r"CPU threads: (\d+ -> \d+)", out.stderr)
    return Run(
        tok_s=result["tokens"] / result["seconds"],
        load_start=load.start,
        load_end=load.end,
        runqueue=queue.mean,
        changes=changes,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--num-warmups", type=int, default=2, help="untimed requests first")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--settings", default="all,reserve1,adaptive", help="which settings, in this order"
    )
    parser.add_argument("--conditions", default="quiet,busy", help="quiet, busy or both")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.num_prompts, args.num_warmups)
        return
    if args.num_prompts < 1 or args.rounds < 1:
        parser.error("--num-prompts and --rounds must be at least 1")
    import torch
    from rich.console import Console
    from rich.table import Table

    cores = torch.get_num_threads()
    known = settings(cores)
    keys = args.settings.split(",")
    try:
        conditions = [c == "busy" for c in parse_conditions(args.conditions)]
    except ValueError as e:
        parser.error(str(e))
    if not set(keys) <= set(known) or "adaptive" not in keys:
        parser.error(
            f"--settings: a comma-separated choice of {', '.join(known)}, adaptive included"
        )
    configs = {known[k][0]: known[k][1] for k in keys}
    adaptive_name = known["adaptive"][0]
    console = Console(width=None if sys.stdout.isatty() else 200)
    console.print(
        f"workload: make bench's, {args.num_prompts} chat prompts, max_tokens 16-128 (seed 0), "
        f"greedy, ignore_eos, fp32, {args.num_warmups} warm-up requests; torch's default: "
        f"{cores} threads; {args.rounds} round(s) of {args.settings} x {args.conditions} "
        "(busy: one busy-loop process beside the engine).\n"
        "'quiet' is only as quiet as this machine is now (other work on it shows in the "
        "load average and run queue): compare rows within this run."
    )
    names = list(configs)
    runs: dict[tuple[str, bool], list[Run]] = {(n, b): [] for n in names for b in conditions}
    for round_ in range(args.rounds):
        order = names[round_ % len(names) :] + names[: round_ % len(names)]
        for busy in conditions if round_ % 2 == 0 else conditions[::-1]:
            for name in order:
                run = measure(configs[name], busy, args)
                runs[name, busy].append(run)
                console.print(
                    f"  round {round_ + 1} {'busy ' if busy else 'quiet'} {name}: "
                    f"{run.tok_s:.1f} tok/s, load {run.load_start:.2f}->{run.load_end:.2f}, "
                    f"run queue {run.runqueue:.2f}"
                    + (f", threads {', '.join(run.changes)}" if run.changes else "")
                )
    adaptive = {b: statistics.mean(r.tok_s for r in runs[adaptive_name, b]) for b in conditions}
    table = Table(title="Offline throughput (output tok/s) by thread setting")
    for col in ("setting", "condition", "tok/s (mean)", "runs", "load avg start->end",
                "run queue", "adaptive / this", "thread changes"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("setting", "condition") else "right")
    for name in names:
        for busy in conditions:
            rs = runs[name, busy]
            mean = statistics.mean(r.tok_s for r in rs)
            table.add_row(
                name,
                "one busy core" if busy else "quiet",
                f"{mean:.1f}",
                " ".join(f"{r.tok_s:.1f}" for r in rs),
                " ".join(f"{r.load_start:.2f}->{r.load_end:.2f}" for r in rs),
                " ".join(f"{r.runqueue:.2f}" for r in rs),
                f"{adaptive[busy] / mean:.2f}x",
                " | ".join(", ".join(r.changes) or "-" for r in rs)
                if name == adaptive_name
                else "",
            )
    console.print(table)


if __name__ == "__main__":
    main()
