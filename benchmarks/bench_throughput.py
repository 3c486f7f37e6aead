"""Offline throughput: tracevllm against HF static batching and vLLM's own CPU build.

The workload (issue: 64 chat prompts, per-request max_tokens drawn from 16-128
with a fixed seed, greedy, ignore_eos; only requested tokens count):
- tracevllm: one ``LLM.generate`` call over all 64 (continuous batching).
- HF: batches of 16 in order, left-padded, each generating to its longest
  request (``min_new_tokens`` = ``max_new_tokens``, so EOS cannot end it early).
- vLLM, with ``VLLM_VENV`` naming a venv that holds the real vLLM CPU build
  (``bash benchmarks/setup_vllm_venv.sh``): the same prompt token ids and
  max_tokens through vLLM's own ``LLM`` (fp32, ``VLLM_CPU_KVCACHE_SPACE=2``),
  with ``enforce_eager=True`` and then its default ``torch.compile`` path
  (benchmarks/vllm_offline.py, a separate process).
tracevllm runs first and again after the others, so the table shows how far
the machine moved in between (on a shared 2-core machine, runs of the same
engine differ by 10-20 %); each row's ratio is the mean of the two tracevllm
runs / that row. Then the cost of each tracing level on the same workload
(or ``--tracing-prompts N`` of its kind): off, request and full back to
back in each of ``--tracing-rounds`` rounds (default 3, the first level
rotating), each level against the same round's off, the median of those
ratios printed. The workload and the tracevllm
and HF runs are ``tracevllm bench throughput``'s (tracevllm/benchmarks/).

Run: ``make bench`` or ``VLLM_VENV=.vllm-venv make bench`` (or ``python
benchmarks/bench_throughput.py [--skip-hf] [--skip-tracing] [--num-prompts N]
[--tracing-prompts N] [--tracing-rounds N]``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from typing import Any

from rich.console import Console
from rich.table import Table

from tracevllm.benchmarks.datasets import SampleRequest, chat_samples
from tracevllm.benchmarks.throughput import run_hf, run_tracevllm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from offline_common import run_in_vllm_venv  # noqa: E402

# vLLM's CPU build: first without torch.compile, then its default compiled path.
VLLM_CONFIGS = [{"enforce_eager": True}, {"enforce_eager": False}]


def bench_tracevllm(samples: list[SampleRequest], **llm_kwargs: Any) -> tuple[float, int]:
    from tracevllm import LLM

    with LLM(**llm_kwargs) as llm:
        elapsed, outs = run_tracevllm(llm, samples, num_warmups=2, use_tqdm=False)
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    asked = sum(s.expected_output_len for s in samples)
    assert generated == asked, (generated, asked)
    return elapsed, generated


def bench_vllm(venv: str, model_dir: str, samples: list[SampleRequest]) -> list[dict[str, Any]]:
    """The same prompt token ids and max_tokens through vLLM's LLM (another process)."""
    job = {
        "model": model_dir,
        "prompts": [s.prompt_token_ids for s in samples],
        "max_tokens": [s.expected_output_len for s in samples],
        "num_warmups": 2,
        "configs": VLLM_CONFIGS,
    }
    results: list[dict[str, Any]] = run_in_vllm_venv(venv, "vllm_offline.py", job)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-tracing", action="store_true")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--tracing-prompts", type=int, help="default: --num-prompts")
    parser.add_argument("--tracing-rounds", type=int, default=3)
    args = parser.parse_args()
    if args.tracing_prompts is None:
        args.tracing_prompts = args.num_prompts
    for flag in ("num_prompts", "tracing_prompts", "tracing_rounds"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    from transformers import AutoTokenizer

    from tracevllm.model_executor.model_loader import resolve_model

    model_dir = resolve_model(None)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    samples = chat_samples(tokenizer, args.num_prompts)
    asked = sum(s.expected_output_len for s in samples)
    console = Console()
    console.print(
        f"workload: {len(samples)} chat prompts, max_tokens 16-128 (seed 0), "
        f"{asked} requested tokens, greedy, ignore_eos, fp32"
    )
    rows: list[tuple[str, int, float]] = []
    t, n = bench_tracevllm(samples)
    rows.append(("tracevllm (continuous batching, 2 processes), first run", n, t))
    if not args.skip_hf:
        rows.append(("HF transformers (static batches of 16)", asked, run_hf(model_dir, samples)))
    venv = os.environ.get("VLLM_VENV")
    if venv:
        for result in bench_vllm(venv, model_dir, samples):
            mode = "enforce_eager" if result["config"]["enforce_eager"] else "torch.compile"
            rows.append((f"vLLM 0.32 CPU ({mode})", result["tokens"], result["seconds"]))
    # tracevllm again, after the others: how far the machine moved meanwhile.
    t, n = bench_tracevllm(samples)
    rows.insert(1, ("tracevllm, second run (after the others)", n, t))
    ours = statistics.mean(tokens / seconds for _, tokens, seconds in rows[:2])
    table = Table(title="Offline throughput (generated tokens / s)")
    for col in ("engine", "tokens", "seconds", "tok/s", "tracevllm (mean of 2) / this"):
        table.add_column(col, justify="right" if col != "engine" else "left")
    for engine, tokens, seconds in rows:
        rate = tokens / seconds
        table.add_row(engine, str(tokens), f"{seconds:.1f}", f"{rate:.1f}", f"{ours / rate:.2f}x")
    console.print(table)
    if not venv:
        console.print("(VLLM_VENV not set: vLLM's CPU build not measured)")

    if args.skip_tracing:
        return
    # Tracing cost: each level in a fresh LLM. The three levels run back to
    # back in each round, the first one rotating round by round; each level
    # is compared with tracing off *of the same round*, and the median of
    # those ratios is printed: a change in the machine's speed between rounds
    # (10-20 % here) then cancels out.
    samples = chat_samples(tokenizer, args.tracing_prompts)
    details = ["off", "request", "full"]
    rates: dict[str, list[float]] = {detail: [] for detail in details}
    for round_ in range(args.tracing_rounds):
        first = round_ % len(details)
        for detail in details[first:] + details[:first]:
            with tempfile.TemporaryDirectory() as d:
                t, n = bench_tracevllm(
                    samples, trace_detail=detail, trace_dir=None if detail == "off" else d
                )
            rates[detail].append(n / t)
    cost = Table(
        title=f"Tracing cost ({len(samples)} prompts, {args.tracing_rounds} rounds, "
        "vs off: median of each round's ratio)"
    )
    for col in ("detail", "median tok/s", "runs", "vs off"):
        cost.add_column(col, justify="right" if col != "detail" else "left")
    for detail, runs in rates.items():
        ratios = [rate / off for rate, off in zip(runs, rates["off"], strict=True)]
        each = " ".join(f"{r:.0f}" for r in runs)
        vs_off = "" if detail == "off" else f"{(statistics.median(ratios) - 1) * 100:+.1f}%"
        cost.add_row(detail, f"{statistics.median(runs):.1f}", each, vs_off)
    console.print(cost)


if __name__ == "__main__":
    main()
