"""The sampler's greedy pick: ``torch.argmax`` against the two passes of
tracevllm/sample/ops/argmax.py, both on this machine, one after the other.

- The pick alone: ``[rows, 49152]`` float32 logits (the default model's
  vocabulary) at each of ``--rows`` and ``--threads``; milliseconds per
  call, best of 5 runs of 20 calls. Both give the same indices (checked).
  Beside them ``amax``, the same reduction without the index.
- The engine: make bench's workload (64 chat prompts, max_tokens 16-128,
  greedy, fp32) through ``LLM`` in this process (``enable_multiprocessing
  =False``, so that the plain argmax can be put back for the other runs),
  alternating (the first of the two alternating too), ``--rounds`` each,
  every run a fresh engine at ``--threads``.

    python benchmarks/bench_greedy.py [--threads 1,2] [--rows 1,16,64,256] [--rounds 2]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
from typing import Any
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

DEFAULT_JSON = "benchmarks/results/greedy.json"
VOCAB = 49152


def pick_alone(rows: int, threads: int) -> dict[str, Any]:
    import torch
    from roofline import best_of

    from tracevllm.sample.ops.argmax import argmax_last_dim

    torch.set_num_threads(threads)
    x = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(rows))
    assert torch.equal(x.argmax(dim=-1), argmax_last_dim(x))
    ms = {
        "argmax": best_of(lambda: x.argmax(dim=-1), repeats=5, inner=20) * 1e3,
        "two_pass": best_of(lambda: argmax_last_dim(x), repeats=5, inner=20) * 1e3,
        # The same reduction without the index: what the first pass costs.
        "amax": best_of(lambda: x.amax(dim=-1), repeats=5, inner=20) * 1e3,
    }
    return {"rows": rows, "threads": threads, "ms": ms}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--rows", default="1,16,64,256")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--skip-engine", action="store_true", help="the pick alone")
    parser.add_argument("--output-json", default=DEFAULT_JSON)
    args = parser.parse_args(argv)
    from bench_throughput import alternate_engines, machine, write_json

    res: dict[str, Any] = {"machine": machine(), "args": vars(args), "pick": [], "engine": []}
    counts = [int(t) for t in args.threads.split(",")]
    for threads in counts:
        for rows in (int(r) for r in args.rows.split(",")):
            r = pick_alone(rows, threads)
            res["pick"].append(r)
            print(
                f"pick alone, {threads} thread(s), {rows} rows: argmax {r['ms']['argmax']:.3f} ms, "
                f"two passes {r['ms']['two_pass']:.3f} ms "
                f"({r['ms']['argmax'] / r['ms']['two_pass']:.1f}x); amax {r['ms']['amax']:.3f} ms",
                flush=True,
            )
    if not args.skip_engine:
        from transformers import AutoTokenizer

        from tracevllm.benchmarks.datasets import chat_samples
        from tracevllm.model_executor.model_loader import resolve_model
        from tracevllm.sample import sampler

        samples = chat_samples(AutoTokenizer.from_pretrained(resolve_model(None)), args.num_prompts)
        plain = mock.patch.object(sampler, "argmax_last_dim", lambda x: x.argmax(dim=-1))
        for threads in counts:
            rates: dict[str, list[float]] = {"argmax": [], "two_pass": []}
            for round_ in range(args.rounds):
                # The first of the two alternates round by round.
                for name in ("argmax", "two_pass")[:: 1 if round_ % 2 == 0 else -1]:
                    with plain if name == "argmax" else contextlib.nullcontext():
                        rates[name] += alternate_engines(
                            samples, threads, 1, {name: {"enable_multiprocessing": False}}
                        )[name]
            gain = statistics.mean(rates["two_pass"]) / statistics.mean(rates["argmax"])
            res["engine"].append({"threads": threads, "tok_s": rates, "gain": gain})
            print(f"engine, {threads} thread(s): two passes / argmax = {gain:.3f}x", flush=True)
    if args.output_json:
        write_json(res, args.output_json)


if __name__ == "__main__":
    main()
