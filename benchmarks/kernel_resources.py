"""What each Triton kernel will take on an A100 (sm_80) and an H100/H200 (sm_90), without a GPU.

Every kernel is compiled ahead of time as its launcher calls it
(``kernels/aot.py``) and the cubin's resource usage is read back: registers
per thread, shared memory per program, local memory (spills), and from those
how many programs one SM can hold at once. Two attention shapes: the default
model (SmolLM2-135M: 9 query heads, 3 KV heads, head size 64) and a
Llama-3-8B layer (32, 8, 128). The MoE layer's grouped GEMM (``fused_moe_kernel``)
at two expert shapes, Qwen3-30B-A3B's and Mixtral-8x7B's, for a decode batch
and a prefill chunk. Timings need the GPU itself: ``make bench-kernels``.

Run: ``make kernel-resources`` (or ``python benchmarks/kernel_resources.py``).
"""

from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console
from rich.table import Table

from kernels.aot import MAX_SHARED_BYTES_PER_PROGRAM, compile_kernels, compile_moe_kernels

SHAPES = {"SmolLM2-135M": (9, 3, 64), "Llama-3-8B": (32, 8, 128)}  # heads, KV heads, head size
# experts, top-k, hidden size, expert intermediate size
MOE_SHAPES = {"Qwen3-30B-A3B": (128, 8, 2048, 768), "Mixtral-8x7B": (8, 2, 4096, 14336)}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90])
    parser.add_argument("--dtype", nargs="+", default=["bf16"], choices=list(DTYPES))
    args = parser.parse_args()

    # Wide enough for the table when the output is a file or a pipe, not a terminal.
    console = Console(width=max(Console().width, 140))
    start = time.perf_counter()
    for arch in args.arch:
        table = Table(
            title=f"sm_{arch}: per program (max shared {MAX_SHARED_BYTES_PER_PROGRAM[arch] >> 10}"
            " KiB)",
            title_justify="left",
        )
        for column in ("shape", "dtype", "kernel", "launch", "warps", "registers"):
            table.add_column(column, justify="left" if column in ("shape", "kernel") else "right")
        for column in ("shared KiB", "spill B", "programs/SM"):
            table.add_column(column, justify="right")
        for shape_name, (num_heads, num_kv_heads, head_size) in SHAPES.items():
            for dtype_name in args.dtype:
                launches = compile_kernels(
                    arch, DTYPES[dtype_name], num_heads, num_kv_heads, head_size
                )
                for launch in launches:
                    kind = {2: "2D", 3: "3D"}[len(launch.grid)]
                    if launch.kernel == "kernel_unified_attention":
                        kind += " (decode)" if len(launch.grid) == 3 else " (mixed)"
                    if launch.variant:
                        kind += f", {launch.variant}"
                    table.add_row(
                        shape_name,
                        dtype_name,
                        launch.kernel,
                        kind,
                        str(launch.num_warps),
                        str(launch.registers),
                        f"{launch.shared_bytes / 1024:.1f}",
                        str(launch.local_bytes),
                        str(launch.programs_per_sm()),
                    )
                table.add_section()
        for shape_name, (experts, top_k, hidden, intermediate) in MOE_SHAPES.items():
            for dtype_name in args.dtype:
                launches = compile_moe_kernels(
                    arch, DTYPES[dtype_name], experts, hidden, intermediate, top_k
                )
                # Per batch size: the gate/up GEMM, then the down GEMM.
                for launch, kind in zip(
                    launches, ["decode w13", "decode w2", "prefill w13", "prefill w2"], strict=True
                ):
                    table.add_row(
                        shape_name,
                        dtype_name,
                        launch.kernel,
                        kind,
                        str(launch.num_warps),
                        str(launch.registers),
                        f"{launch.shared_bytes / 1024:.1f}",
                        str(launch.local_bytes),
                        str(launch.programs_per_sm()),
                    )
                table.add_section()
        console.print(table)
    console.print(
        f"compiled with triton (ptxas from the wheel), no GPU used, in "
        f"{time.perf_counter() - start:.0f} s"
    )


if __name__ == "__main__":
    main()
