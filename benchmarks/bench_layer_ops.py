"""The layers' C++ kernels (kernels/csrc/cpu_ops.cpp) against their PyTorch ops.

Two measurements, both on this machine, one after the other:

- The ops alone, at the default model's shapes (hidden 576, 9 query and 3 KV
  heads of 64, intermediate 1536, 16-token pages) for a decode step's batch
  (``--batch`` rows) and a prefill's (``--prefill`` rows): each layer's
  ``forward_native`` (PyTorch) and ``forward_cpu`` (the kernel) for the
  residual add with RMSNorm, SiLU-and-mul and RoPE, and the K/V write
  (``reshape_and_cache_flash_torch`` against the C++ copy); microseconds per
  call, best of 5 runs of 200 calls, and per step: two norms, one SiLU-and-mul, one RoPE
  and one write per layer, times 30 layers.
- The engine: make bench's workload (64 chat prompts, max_tokens 16-128,
  greedy, fp32) through ``LLM`` with ``compilation_config={"custom_ops":
  ["none"]}`` (every layer's PyTorch ops) and ``["all"]`` (the default when
  nothing is compiled), alternating, ``--rounds`` each, every run a fresh
  engine, at each of ``--threads`` (1: the count the adaptive policy
  settles on beside a busy process). The K/V write is the C++ copy in both:
  it belongs to the attention backend, not to ``custom_ops``.

    python benchmarks/bench_layer_ops.py [--threads 1,2] [--rounds 2] [--output-json F]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

DEFAULT_JSON = "benchmarks/results/layer_ops.json"
HIDDEN, HEADS, KV_HEADS, HEAD_SIZE, INTERMEDIATE, LAYERS = 576, 9, 3, 64, 1536, 30


def _best_us(fn: Callable[[], Any]) -> float:
    """Microseconds per call, best of 5 runs of 200 calls (roofline.py's ``best_of``)."""
    from roofline import best_of

    return best_of(fn, repeats=5, inner=200) * 1e6


def ops_alone(rows: int, threads: int) -> dict[str, Any]:
    """Microseconds per call of each op both ways, and per step over every layer."""
    import torch

    from kernels.reshape_and_cache_flash import reshape_and_cache_flash_torch
    from tracevllm import _custom_ops as ops
    from tracevllm.model_executor.layers.activation import SiluAndMul
    from tracevllm.model_executor.layers.layernorm import RMSNorm
    from tracevllm.model_executor.layers.rotary_embedding import RotaryEmbedding
    from tracevllm.platforms.cpu import tune_malloc

    tune_malloc()  # as the engine's worker
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(rows)
    norm, act = RMSNorm(HIDDEN, 1e-5), SiluAndMul()
    rope = RotaryEmbedding(HEAD_SIZE, 8192, 100000.0)
    x, residual = torch.randn(rows, HIDDEN, generator=gen), torch.randn(rows, HIDDEN, generator=gen)
    gate_up = torch.randn(rows, 2 * INTERMEDIATE, generator=gen)
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_SIZE, generator=gen)
    q, k, v = qkv.split([HEADS * HEAD_SIZE, KV_HEADS * HEAD_SIZE, KV_HEADS * HEAD_SIZE], -1)
    key, value = k.view(rows, KV_HEADS, HEAD_SIZE), v.view(rows, KV_HEADS, HEAD_SIZE)
    positions = torch.randint(0, 2048, (rows,), generator=gen)
    cache = torch.zeros(rows // 16 + 64, 2, 16, KV_HEADS, HEAD_SIZE)
    slots = torch.randperm(cache.shape[0] * 16, generator=gen)[:rows]
    us: dict[str, dict[str, float]] = {}
    with torch.no_grad():
        for path in ("native", "cpu"):
            fwd = f"forward_{path}"
            us[path] = {
                "add_rms_norm": _best_us(lambda f=fwd: getattr(norm, f)(x, residual)),
                "silu_and_mul": _best_us(lambda f=fwd: getattr(act, f)(gate_up)),
                "rotary_embedding": _best_us(lambda f=fwd: getattr(rope, f)(positions, q, k)),
                "kv_write": _best_us(
                    (lambda: reshape_and_cache_flash_torch(key, value, cache, slots))
                    if path == "native"
                    else (
                        lambda: ops.reshape_and_cache_flash(key, value, cache, slots, backend="cpu")
                    )
                ),
            }
            ops_us = us[path]
            per_layer = 2 * ops_us["add_rms_norm"] + sum(
                ops_us[o] for o in ("silu_and_mul", "rotary_embedding", "kv_write")
            )
            us[path]["step_ms"] = per_layer * LAYERS / 1e3
    return {"rows": rows, "threads": threads, "us": us}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--skip-engine", action="store_true", help="the ops alone")
    parser.add_argument("--output-json", default=DEFAULT_JSON)
    args = parser.parse_args(argv)

    from kernels.cpu_attn import cpu_kernels_available

    if not cpu_kernels_available():
        sys.exit("The CPU kernels could not be built here (see the warning above).")
    from bench_throughput import alternate_engines, machine, write_json

    res: dict[str, Any] = {"machine": machine(), "args": vars(args), "ops": [], "engine": []}
    counts = [int(t) for t in args.threads.split(",")]
    for threads in counts:
        for rows in (args.batch, args.prefill):
            r = ops_alone(rows, threads)
            res["ops"].append(r)
            cells = ", ".join(
                f"{op} {r['us']['native'][op]:.0f} -> {r['us']['cpu'][op]:.0f} us"
                for op in ("add_rms_norm", "silu_and_mul", "rotary_embedding", "kv_write")
            )
            print(
                f"ops alone, {threads} thread(s), {rows} rows: {cells}; per step "
                f"{r['us']['native']['step_ms']:.1f} -> {r['us']['cpu']['step_ms']:.1f} ms",
                flush=True,
            )
    if not args.skip_engine:
        from transformers import AutoTokenizer

        from tracevllm.benchmarks.datasets import chat_samples
        from tracevllm.model_executor.model_loader import resolve_model

        samples = chat_samples(AutoTokenizer.from_pretrained(resolve_model(None)), args.num_prompts)
        # The keys are custom_ops' values: "none" (PyTorch ops) and "all" (the kernels).
        variants = {ops: {"compilation_config": {"custom_ops": [ops]}} for ops in ("none", "all")}
        for threads in counts:
            rates = alternate_engines(samples, threads, args.rounds, variants)
            gain = statistics.mean(rates["all"]) / statistics.mean(rates["none"])
            res["engine"].append({"threads": threads, "tok_s": rates, "gain": gain})
            print(f"engine, {threads} thread(s): kernels / PyTorch ops = {gain:.2f}x", flush=True)
    if args.output_json:
        write_json(res, args.output_json)


if __name__ == "__main__":
    main()
