"""``tracevllm bench latency``: the latency of one batch, step by step.

Mirrors vllm/benchmarks/latency.py: ``--batch-size`` prompts of
``--input-len`` random token ids, each generating ``--output-len`` tokens
(``ignore_eos``, temperature 1.0 as vLLM's), ``--num-iters-warmup`` untimed
runs, then ``--num-iters`` timed ones; prefix caching off by default (it
would skew the figures). vLLM's results, with its JSON keys: ``avg_latency``,
``latencies`` and ``percentiles`` (10, 25, 50, 75, 90, 99) of one batch, in
seconds. tracevllm adds what happens inside a batch, each engine step timed
as its tokens come back: ``avg_step_latency``, ``step_latencies`` and
``step_percentiles`` (seconds), and ``bench serve``'s ``mean_ttft_ms``, ``p99_itl_ms`` ... over
every request of every timed run. Left out: ``--n``, beam search, ``--profile``.
"""

from __future__ import annotations

import argparse
import random
import statistics
from typing import Any

from tracevllm.benchmarks.datasets import SampleRequest
from tracevllm.benchmarks.offline import TimedRun, make_llm, run_timed, write_json
from tracevllm.benchmarks.serve import _percentile, calculate_metrics

PERCENTAGES = [10, 25, 50, 75, 90, 99]
PER_TOKEN = ("ttft", "itl", "tpot", "e2el")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    from tracevllm.engine.arg_utils import EngineArgs

    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-iters-warmup", type=int, default=10)
    parser.add_argument("--num-iters", type=int, default=30)
    parser.add_argument("--output-json", default=None, help="write the results here")
    parser.add_argument("--disable-detokenize", action="store_true")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(enable_prefix_caching=False)


def summarize(runs: list[TimedRun]) -> dict[str, Any]:
    """vLLM's keys for the batch latencies, then the per-step and per-token ones."""
    latencies = [r.duration for r in runs]
    steps = [s for r in runs for s in r.step_latencies]
    per_token = calculate_metrics([o for r in runs for o in r.outputs], 1.0, [50.0, 90.0, 99.0])
    return {
        "avg_latency": statistics.fmean(latencies),
        "latencies": latencies,
        "percentiles": {p: _percentile(latencies, p) for p in PERCENTAGES},
        "avg_step_latency": statistics.fmean(steps),
        "step_latencies": steps,
        "step_percentiles": {p: _percentile(steps, p) for p in PERCENTAGES},
        "num_steps": len(steps) // len(runs),
        "total_output_tokens": sum(o.output_tokens for o in runs[-1].outputs),
    } | {k: v for k, v in per_token.items() if k.endswith("_ms") and k.split("_")[-2] in PER_TOKEN}


def main(args: argparse.Namespace) -> int:
    for flag in ("input_len", "output_len", "batch_size", "num_iters"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}.")
    rng = random.Random(args.seed)
    with make_llm(args) as llm:
        max_len = llm.llm_engine.model_config.get_max_model_len()
        if args.input_len + args.output_len > max_len:
            raise ValueError(
                f"--input-len + --output-len ({args.input_len + args.output_len}) exceeds "
                f"the model's max_model_len ({max_len})."
            )
        vocab = min(10000, llm.get_tokenizer().vocab_size)
        batch = [
            SampleRequest([rng.randrange(vocab) for _ in range(args.input_len)], args.output_len)
            for _ in range(args.batch_size)
        ]

        def one(description: str) -> TimedRun:
            return run_timed(llm, batch, 1.0, not args.disable_detokenize, description=description)

        print("Warming up...")
        for i in range(args.num_iters_warmup):
            one(f"Warmup iteration {i + 1}/{args.num_iters_warmup}")
        runs = [one(f"Bench iteration {i + 1}/{args.num_iters}") for i in range(args.num_iters)]
    result = summarize(runs) | {
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
    }
    print(f"Avg latency: {result['avg_latency']} seconds")
    for p, value in result["percentiles"].items():
        print(f"{p}% percentile latency: {value} seconds")
    print(f"Avg step latency: {result['avg_step_latency'] * 1000:.2f} ms over "
          f"{result['num_steps']} steps a batch")  # fmt: skip
    for p, value in result["step_percentiles"].items():
        print(f"{p}% percentile step latency: {value * 1000:.2f} ms")
    print(f"Mean TTFT: {result['mean_ttft_ms']:.2f} ms, mean ITL: {result['mean_itl_ms']:.2f} ms, "
          f"P99 ITL: {result['p99_itl_ms']:.2f} ms")  # fmt: skip
    if args.output_json:
        write_json(args.output_json, result)
    return 0
