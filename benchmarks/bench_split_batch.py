"""Would two half-batches on two threads beat one thread beside a busy core?

tracevllm's own question (no vLLM counterpart: vLLM's micro-batches,
``vllm/v1/worker/ubatching.py``, take turns on one GPU to hide
communication; they never compute at once). On a 2-core machine with one
busy process, both engines end up computing a step on one thread: every
core to OpenMP stalls at each parallel region's barrier whenever the
kernel deschedules one of its threads. Split the batch instead, each half
on its own Python thread with one OpenMP thread, and the two meet once per
step, not at every region: the kernel's fair share then gives the engine
two of the three runnable threads' time, 1.33 cores, where one thread gets
one.

This times that without the engine: a decode step's linear layers (the
default model's shapes, packed for oneDNN as the engine packs them; each
layer its own weights) and the LM head, with SiLU between gate/up and down
and the residual add, at batch ``--batch``, three ways:

- **1 thread**: the whole batch, one OpenMP thread (the engine beside a busy core);
- **2 OpenMP threads**: the whole batch, torch's two threads (the engine quiet);
- **2 half-batches**: two Python threads, each half the batch on one OpenMP thread.

Quiet and beside one busy-loop process (benchmarks/busy.py), the median of
``--repeats`` steps each. The matmuls are about four fifths of a one-thread
decode step in the engine (benchmarks/profile_step.py), so what holds here
bounds what splitting the engine's batch could gain.

    python benchmarks/bench_split_batch.py [--batch 32 64] [--repeats 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from busy import LABELS, busy_core  # noqa: E402
from roofline import PackedLinears, model_shapes, packed_linears  # noqa: E402


def forward(linears: PackedLinears, batch: int) -> None:
    """A decode step's linears at ``batch`` rows (roofline.py's, packed as the
    engine packs them), SiLU and the residual adds between, then the LM head."""
    with torch.inference_mode():  # per thread, as the engine's forward
        x = torch.randn(batch, linears.lm_head.input_size)
        for layer in linears.layers:
            layer["qkv_proj"](x)
            x = x + layer["o_proj"](x)[0] * 0.01
            h = layer["gate_up_proj"](x)[0]
            d = h.shape[-1] // 2
            x = x + layer["down_proj"](torch.nn.functional.silu(h[:, :d]) * h[:, d:])[0] * 0.01
        linears.lm_head(x)[0].argmax(-1)


def one_thread(step: Callable[[int], None], batch: int) -> None:
    torch.set_num_threads(1)
    step(batch)


def two_omp_threads(step: Callable[[int], None], batch: int) -> None:
    torch.set_num_threads(2)
    step(batch)


def two_halves(step: Callable[[int], None], batch: int) -> None:
    def half() -> None:
        torch.set_num_threads(1)  # per thread: OpenMP's count is the caller's
        step(batch // 2)

    threads = [threading.Thread(target=half) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


WAYS = {"1 thread": one_thread, "2 OpenMP threads": two_omp_threads, "2 half-batches": two_halves}


def median_ms(run: Callable[[], None], repeats: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args(argv)
    shapes = model_shapes()
    linears = packed_linears(shapes)

    def step(batch: int) -> None:
        forward(linears, batch)

    before = torch.get_num_threads()
    cpus = os.cpu_count()
    print(f"{shapes['name']}'s linears, {cpus} CPUs, median of {args.repeats} steps (ms):")
    try:
        for condition in ("quiet", "busy"):
            with busy_core(condition == "busy"):
                for batch in args.batch:
                    cells = {
                        name: median_ms(lambda way=way, b=batch: way(step, b), args.repeats)
                        for name, way in WAYS.items()
                    }
                    text = ", ".join(f"{name} {ms:.0f}" for name, ms in cells.items())
                    speedup = cells["1 thread"] / cells["2 half-batches"]
                    print(f"{LABELS[condition]:>13}, batch {batch}: {text}; "
                          f"the halves' speed-up: {speedup:.2f}x", flush=True)  # fmt: skip
    finally:
        torch.set_num_threads(before)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
