"""Offline throughput: tracevllm against HF transformers static batching.

The workload (issue: 64 chat prompts, per-request max_tokens drawn from 16-128
with a fixed seed, greedy, ignore_eos; only requested tokens count):
- tracevllm: one ``LLM.generate`` call over all 64 (continuous batching).
- HF: batches of 16 in order, left-padded, each generating to its longest
  request (``min_new_tokens`` = ``max_new_tokens``, so EOS cannot end it early).
Then the cost of each tracing level on a smaller workload.

Run: ``make bench`` (or ``python benchmarks/bench_throughput.py [--skip-hf]``).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from typing import Any

from rich.console import Console
from rich.table import Table

TOPICS = [
    "the French Revolution",
    "photosynthesis",
    "black holes",
    "the stock market",
    "machine learning",
    "the Roman Empire",
    "climate change",
    "the human heart",
    "volcanoes",
    "jazz music",
    "the internet",
    "honey bees",
    "chess openings",
    "the moon landing",
    "coffee",
    "electric cars",
]
TEMPLATES = [
    "Explain {} to a ten-year-old.",
    "Write a short story about {}.",
    "What are three surprising facts about {}?",
    "Summarize the history of {} in a paragraph.",
]


def workload(n: int = 64, seed: int = 0) -> tuple[list[list[dict[str, str]]], list[int]]:
    rng = random.Random(seed)
    convs = [
        [{"role": "user", "content": TEMPLATES[i % 4].format(TOPICS[(i // 4) % 16])}]
        for i in range(n)
    ]
    return convs, [rng.randint(16, 128) for _ in range(n)]


def bench_tracevllm(convs: Any, max_tokens: list[int], **llm_kwargs: Any) -> tuple[float, int]:
    from tracevllm import LLM, SamplingParams

    with LLM(**llm_kwargs) as llm:
        tok = llm.get_tokenizer()
        prompts = [
            {
                "prompt_token_ids": tok.encode(
                    tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
                    add_special_tokens=False,
                )
            }
            for c in convs
        ]
        params = [
            SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens
        ]
        llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    assert generated == sum(max_tokens), (generated, sum(max_tokens))
    return elapsed, generated


def bench_hf(convs: Any, max_tokens: list[int], batch_size: int = 16) -> tuple[float, int]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tracevllm.model_executor.model_loader import resolve_model

    path = resolve_model(None)
    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    texts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in convs]
    with torch.inference_mode():
        batch = tok(texts[:2], return_tensors="pt", padding=True, add_special_tokens=False)
        model.generate(**batch, max_new_tokens=4, do_sample=False)  # warm-up
        t0 = time.perf_counter()
        for i in range(0, len(texts), batch_size):
            batch = tok(
                texts[i : i + batch_size],
                return_tensors="pt",
                padding=True,
                add_special_tokens=False,
            )
            longest = max(max_tokens[i : i + batch_size])
            model.generate(
                **batch,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=tok.pad_token_id or tok.eos_token_id,
            )
        elapsed = time.perf_counter() - t0
    return elapsed, sum(max_tokens)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-tracing", action="store_true")
    args = parser.parse_args()
    console = Console()
    convs, max_tokens = workload()
    console.print(
        f"workload: {len(convs)} chat prompts, max_tokens 16-128 (seed 0), "
        f"{sum(max_tokens)} requested tokens, greedy, ignore_eos"
    )
    table = Table(title="Offline throughput (generated tokens / s)")
    for col in ("engine", "tokens", "seconds", "tok/s"):
        table.add_column(col, justify="right" if col != "engine" else "left")
    t, n = bench_tracevllm(convs, max_tokens)
    ours = n / t
    table.add_row("tracevllm (continuous batching, 2 processes)", str(n), f"{t:.1f}", f"{ours:.1f}")
    if not args.skip_hf:
        t, n = bench_hf(convs, max_tokens)
        hf = n / t
        table.add_row("HF transformers (static batches of 16)", str(n), f"{t:.1f}", f"{hf:.1f}")
    console.print(table)
    if not args.skip_hf:
        console.print(f"[bold]tracevllm / HF = {ours / hf:.2f}x[/]")

    if args.skip_tracing:
        return
    # Tracing cost: a smaller workload, each level in a fresh LLM.
    convs, max_tokens = workload(16, seed=1)
    cost = Table(title="Tracing cost (16 prompts, same workload each row)")
    for col in ("detail", "tok/s", "vs off"):
        cost.add_column(col, justify="right" if col != "detail" else "left")
    base = None
    for detail in ("off", "request", "full"):
        with tempfile.TemporaryDirectory() as d:
            t, n = bench_tracevllm(
                convs, max_tokens, trace_detail=detail, trace_dir=None if detail == "off" else d
            )
        rate = n / t
        base = base or rate
        cost.add_row(detail, f"{rate:.1f}", f"{(rate / base - 1) * 100:+.1f}%")
    console.print(cost)


if __name__ == "__main__":
    main()
