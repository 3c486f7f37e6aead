"""The CPU attention kernel against the plain-PyTorch reference it replaces for decodes.

Two measurements, both on this machine, one after the other:

- The read alone: one decode step's attention over every layer of the
  default model's shape (30 layers, 9 query heads, 3 KV heads, head size 64,
  16-token pages), a batch of ``--batch`` decodes with cached lengths drawn
  from 40-170 (make bench's prompts and outputs), each layer its own cache as
  in the engine, so the pages come from memory. The reference
  (``unified_attention_torch``: gather the pages into a padded tensor, SDPA
  with a mask) and the kernel (``cpu_attention_with_kv_cache``: each key read
  where it lies), best of 5, and their largest difference. The allocator is
  tuned as in the engine's worker (``tune_malloc``).
- The engine: make bench's workload (64 chat prompts, max_tokens 16-128,
  greedy, fp32) through ``LLM`` with ``attention_backend="torch"`` and
  ``"cpu_attn"``, alternating, ``--rounds`` each, every run a fresh engine,
  at each of ``--threads`` (1: the count the adaptive policy settles on
  beside a busy process).

    python benchmarks/bench_cpu_attn.py [--threads 1,2] [--rounds 2] [--output-json F]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

DEFAULT_JSON = "benchmarks/results/cpu_attn.json"


# The default model's attention: layers, query heads, KV heads, head size; 16-token pages.
LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 30, 9, 3, 64, 16


def _layer_caches(gen: Any, requests: int, pages: int) -> tuple[list[Any], Any]:
    """A random paged cache per layer (so that a forward reads them from memory,
    as the engine's does) and a block table giving each request ``pages``
    pages of its own, in shuffled order (block 0 unused)."""
    import torch

    num_blocks = requests * pages + 1
    caches = [
        torch.randn(num_blocks, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, generator=gen)
        for _ in range(LAYERS)
    ]
    table = torch.randperm(num_blocks - 1, generator=gen)[: requests * pages] + 1
    return caches, table.view(requests, pages).to(torch.int32)


def read_alone(batch: int, threads: int, seed: int = 0) -> dict[str, Any]:
    """ms per step (every layer) of the reference and of the kernel, best of 5."""
    import torch

    from kernels.unified_attention import unified_attention_torch
    from tracevllm import _custom_ops as ops
    from tracevllm.platforms.cpu import tune_malloc

    tune_malloc()  # as the engine's worker: the gather's buffers come from the heap

    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(40, 171, (batch,), dtype=torch.int32, generator=gen)
    caches, table = _layer_caches(gen, batch, -(-int(lens.max()) // BLOCK_SIZE))
    q = torch.randn(batch, NUM_HEADS, HEAD_SIZE, generator=gen)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    scale = HEAD_SIZE**-0.5
    ref_out, out = torch.empty_like(q), torch.empty_like(q)

    def reference() -> None:
        for cache in caches:
            unified_attention_torch(q, cache, ref_out, qsl, lens, 1, int(lens.max()), table, scale)

    def kernel() -> None:
        for cache in caches:
            ops.cpu_attention_with_kv_cache(q, cache, out, qsl, lens, scale, table)

    ms = _best_ms({"reference": reference, "kernel": kernel}, threads)
    return {
        "threads": threads,
        "batch": batch,
        "mean_len": float(lens.float().mean()),
        "reference_ms": ms["reference"],
        "kernel_ms": ms["kernel"],
        "speedup": ms["reference"] / ms["kernel"],
        "max_abs_diff": float((ref_out - out).abs().max()),
    }


# (name, requests, query tokens, seq_len): make bench's prefill step (its chat
# prompts past the shared first page), shapes under SMALL_QUERY_LIMIT's pairs
# (a fresh prompt attends half its square: 128 tokens, 8256 pairs), two near
# it, and two past it, which stay with SDPA.
PREFILL_SHAPES = [
    ("make bench's prefill step", 64, 24, 40),
    ("prompt of 64", 1, 64, 64),
    ("prompt of 128", 1, 128, 128),
    ("chunk of 64 over 256", 1, 64, 256),
    ("chunk of 16 over 1024", 1, 16, 1024),
    ("chunk of 64 over 1024", 1, 64, 1024),
    ("prompt of 512", 1, 512, 512),
]


def prefill_alone(
    requests: int, q_len: int, seq_len: int, threads: int, seed: int = 0
) -> dict[str, Any]:
    """ms for every layer of the default model's shape, attending ``requests``
    queries of ``q_len`` tokens over ``seq_len`` keys each: one SDPA call per
    request (the CPU backend's path past SMALL_QUERY_LIMIT) against one call
    of the kernel for all of them; best of 5."""
    import torch

    from tracevllm import _custom_ops as ops
    from tracevllm.platforms.cpu import tune_malloc

    tune_malloc()
    gen = torch.Generator().manual_seed(seed)
    caches, table = _layer_caches(gen, requests, -(-seq_len // BLOCK_SIZE))
    q = torch.randn(requests * q_len, NUM_HEADS, HEAD_SIZE, generator=gen)
    qsl = torch.arange(0, requests * q_len + 1, q_len, dtype=torch.int32)
    lens = torch.full((requests,), seq_len, dtype=torch.int32)
    one = torch.tensor([0, q_len], dtype=torch.int32)
    scale = HEAD_SIZE**-0.5
    sdpa_out, out = torch.empty_like(q), torch.empty_like(q)

    def sdpa() -> None:
        for cache in caches:
            for r in range(requests):
                rows = slice(r * q_len, (r + 1) * q_len)
                ops.unified_attention(
                    q=q[rows], kv_cache=cache, out=sdpa_out[rows], query_start_loc=one,
                    seq_lens=lens[r : r + 1], max_query_len=q_len, max_seq_len=seq_len,
                    block_table=table[r : r + 1], softmax_scale=scale,
                )  # fmt: skip

    def kernel() -> None:
        for cache in caches:
            # A limit past any query's pairs: the kernel takes every shape here.
            ops.cpu_attention_with_kv_cache(q, cache, out, qsl, lens, scale, table, q_len * seq_len)

    ms = _best_ms({"sdpa": sdpa, "kernel": kernel}, threads)
    return {
        "threads": threads,
        "requests": requests,
        "query_tokens": q_len,
        "seq_len": seq_len,
        "sdpa_ms": ms["sdpa"],
        "kernel_ms": ms["kernel"],
        "speedup": ms["sdpa"] / ms["kernel"],
        "max_abs_diff": float((sdpa_out - out).abs().max()),
    }


def _best_ms(fns: dict[str, Any], threads: int) -> dict[str, float]:
    """Each function's best of 5 (after one untimed call), in ms, at ``threads``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ms = {}
        for name, fn in fns.items():
            fn()
            best = float("inf")
            for _ in range(5):
                start = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - start)
            ms[name] = best * 1e3
    finally:
        torch.set_num_threads(before)
    return ms


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1", help="comma-separated thread counts")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--skip-engine", action="store_true", help="the read alone")
    parser.add_argument("--output-json", default=DEFAULT_JSON)
    args = parser.parse_args(argv)

    from kernels.cpu_attn import cpu_kernels_available

    if not cpu_kernels_available():
        sys.exit("The CPU attention kernel could not be built here (see the warning above).")
    from bench_throughput import alternate_engines, machine, write_json

    res: dict[str, Any] = {"machine": machine(), "args": vars(args), "read": [], "engine": []}
    counts = [int(t) for t in args.threads.split(",")]
    for threads in counts:
        r = read_alone(args.batch, threads)
        res["read"].append(r)
        print(
            f"read alone, {threads} thread(s), batch {r['batch']}, mean length "
            f"{r['mean_len']:.0f}, 30 layers: reference {r['reference_ms']:.1f} ms, kernel "
            f"{r['kernel_ms']:.1f} ms ({r['speedup']:.2f}x), max |diff| {r['max_abs_diff']:.1e}",
            flush=True,
        )
    res["prefill"] = []
    for threads in counts:
        for name, requests, q_len, seq_len in PREFILL_SHAPES:
            r = {"shape": name, **prefill_alone(requests, q_len, seq_len, threads)}
            res["prefill"].append(r)
            print(
                f"prefill alone, {threads} thread(s), {name} ({requests} x {q_len} tokens over "
                f"{seq_len}), 30 layers: SDPA per request {r['sdpa_ms']:.1f} ms, kernel "
                f"{r['kernel_ms']:.1f} ms ({r['speedup']:.2f}x), max |diff| "
                f"{r['max_abs_diff']:.1e}",
                flush=True,
            )
    if not args.skip_engine:
        from transformers import AutoTokenizer

        from tracevllm.benchmarks.datasets import chat_samples
        from tracevllm.model_executor.model_loader import resolve_model

        samples = chat_samples(AutoTokenizer.from_pretrained(resolve_model(None)), args.num_prompts)
        variants = {backend: {"attention_backend": backend} for backend in ("torch", "cpu_attn")}
        for threads in counts:
            rates = alternate_engines(samples, threads, args.rounds, variants)
            gain = statistics.mean(rates["cpu_attn"]) / statistics.mean(rates["torch"])
            res["engine"].append({"threads": threads, "tok_s": rates, "gain": gain})
            print(f"engine, {threads} thread(s): cpu_attn / torch = {gain:.2f}x", flush=True)
    if args.output_json:
        write_json(res, args.output_json)


if __name__ == "__main__":
    main()
