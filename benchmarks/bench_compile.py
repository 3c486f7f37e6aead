"""tracevllm eager against tracevllm compiled (issue 27, goal 2's gain).

``make bench``'s workload (64 chat prompts, max_tokens 16-128, greedy, fp32)
through tracevllm's ``LLM`` four times, alternating ``enforce_eager=True``
and ``enforce_eager=False`` (vLLM's compiled path: Dynamo captures the
forward, split at attention, each piece compiled by inductor), each in a
fresh engine. Prints each run's tok/s over the timed ``generate`` and its
wall time with start-up, so the compile's cost shows beside its gain: the
first compiled start compiles (or reads the compile cache left by an earlier
run: clear ``TRACEVLLM_CACHE_DIR`` for a cold start), the second reads the
cache. ``--conditions quiet,busy`` repeats the four runs beside one
busy-loop process (benchmarks/busy.py, as ``make bench``); compare within
one run.

    python benchmarks/bench_compile.py [--num-prompts N] [--conditions C] [--output-json F]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--conditions", default="quiet", help="quiet, busy or both")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()

    import busy
    from bench_throughput import bench_tracevllm
    from transformers import AutoTokenizer

    from tracevllm.benchmarks.datasets import chat_samples
    from tracevllm.model_executor.model_loader import resolve_model

    model = resolve_model(None)
    samples = chat_samples(AutoTokenizer.from_pretrained(model), args.num_prompts)
    conditions = busy.parse_conditions(args.conditions)
    res: dict = {"machine": busy.machine(), "num_prompts": len(samples), "runs": []}
    for condition in conditions:
        for mode in ("eager", "compiled", "eager", "compiled"):
            start = time.perf_counter()
            with busy.under(condition) as load:
                seconds, tokens, _, threads = bench_tracevllm(
                    samples, model=model, enforce_eager=mode == "eager"
                )
            wall = time.perf_counter() - start
            res["runs"].append({"condition": condition, "mode": mode, "tok_s": tokens / seconds,
                                "seconds": seconds, "wall_with_start_s": wall,
                                "threads": threads, "load": [load.start, load.end]})  # fmt: skip
            print(f"{busy.LABELS[condition]:<13} {mode:>8}: {tokens / seconds:.1f} tok/s "
                  f"({seconds:.1f} s timed, {wall:.1f} s with start-up), threads "
                  f"{threads['threads']}, {load}", flush=True)  # fmt: skip
    res["compiled_over_eager"] = {}
    for condition in conditions:
        runs = [r for r in res["runs"] if r["condition"] == condition]
        mean = {m: sum(r["tok_s"] for r in runs if r["mode"] == m) / 2
                for m in ("eager", "compiled")}  # fmt: skip
        res["compiled_over_eager"][condition] = ratio = mean["compiled"] / mean["eager"]
        print(f"{busy.LABELS[condition]}: compiled / eager (mean of two runs each): {ratio:.2f}x")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(res, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
