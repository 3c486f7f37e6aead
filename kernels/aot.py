"""Compile the kernels for a GPU that is not here, and read what each program will use.

Triton lowers a kernel to PTX, and ``ptxas`` (shipped inside the triton wheel)
assembles the PTX into a cubin for a named architecture: sm_80 (A100), sm_90
(H100, H200). Neither step touches a GPU. So a machine without one can still
check that every kernel compiles for the GPUs it targets, with exactly the
arguments its launcher passes, and read from the cubin what one program
(a CTA) will take: registers per thread, shared memory, and local memory,
which is where registers spill. Those bound how many programs an SM keeps in
flight at once (occupancy). It says nothing about speed or about numerical
results on the device: that needs the GPU itself (``make bench-kernels``).
One difference from a real launch: Triton's JIT specializes integer
arguments (an int equal to 1 becomes a constant, a multiple of 16 is marked
aligned), which is left out here, so a device's figures can differ a little.

Usage: inside ``compile_launches(module, ["kernel", ...], arch=90)``, calling a
launcher (``unified_attention_triton(...)``) with CPU tensors compiles each
launch of the named kernels instead of running it and records a
``CompiledLaunch``. Not mirrored from vLLM (it compiles on the device, at
first launch); ``python -m triton.tools.compile`` is Triton's own AOT tool.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any

import torch

from kernels.triton_utils import triton

# Per SM, from NVIDIA's CUDA C++ Programming Guide (compute capabilities table):
# 32-bit registers, shared memory, and the most shared memory one program
# (thread block) may opt into.
REGISTERS_PER_SM = 64 * 1024
SHARED_BYTES_PER_SM = {80: 164 * 1024, 86: 100 * 1024, 89: 100 * 1024, 90: 228 * 1024}
MAX_SHARED_BYTES_PER_PROGRAM = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
MAX_PROGRAMS_PER_SM = {80: 32, 86: 16, 89: 24, 90: 32}

_TRITON_TYPES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.int32: "i32",
    torch.int64: "i64",
}


@dataclass(frozen=True)
class CompiledLaunch:
    """One launch of one kernel, compiled for ``sm_<arch>``."""

    kernel: str
    arch: int
    grid: tuple[int, ...]
    dtype: str  # the first pointer argument's element type
    num_warps: int
    registers: int  # per thread
    shared_bytes: int  # per program: static + dynamic
    local_bytes: int  # per thread; > 0 means registers spilled to local memory
    variant: str = ""  # compile-time options that make it a kernel of its own

    def programs_per_sm(self) -> int:
        """How many of these programs one SM can hold at once: the tightest of its limits.

        Registers are handed out per warp in units of 256 (8 per thread).
        0 means the program does not fit at all (too much shared memory).
        """
        if self.shared_bytes > MAX_SHARED_BYTES_PER_PROGRAM[self.arch]:
            return 0
        registers = -(-self.registers // 8) * 8 * 32 * self.num_warps
        limits = [REGISTERS_PER_SM // registers, MAX_PROGRAMS_PER_SM[self.arch]]
        if self.shared_bytes:
            limits.append(SHARED_BYTES_PER_SM[self.arch] // self.shared_bytes)
        return min(limits)


def _triton_type(value: Any) -> str:
    if torch.is_tensor(value):
        return "*" + _TRITON_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def _resource_usage(cubin: bytes, name: str) -> dict[str, int]:
    """REG, SHARED and LOCAL of ``name`` in ``cubin``, from cuobjdump (shipped with Triton)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    # cuobjdump reads a file; a private temp dir keeps parallel runs apart.
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{name}.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        out = subprocess.run(
            [tool, "--dump-resource-usage", path], capture_output=True, text=True, check=True
        ).stdout
    # "Function kernel_x:\n  REG:159 STACK:0 SHARED:1024 LOCAL:0 ..."
    match = re.search(rf"Function {re.escape(name)}:\s*\n\s*(.*)", out)
    if match is None:
        raise RuntimeError(f"cuobjdump printed no resource usage for {name}:\n{out}")
    return {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", match.group(1))}


class _CompileOnly:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](...)`` compiles, records, returns."""

    def __init__(self, kernel: Any, arch: int, record: list[CompiledLaunch]) -> None:
        self.kernel, self.arch, self.record = kernel, arch, record

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.compile(tuple(grid), args, kwargs)

        return launch

    def compile(self, grid: tuple[int, ...], args: tuple, kwargs: dict[str, Any]) -> None:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        fn = self.kernel
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
        # What a launch gets by default in triton 3.9, said explicitly (left
        # unset, Triton warns that 3.10 will change the default).
        options["enable_fp_fusion"] = True
        values = dict(zip(fn.arg_names, args, strict=False)) | kwargs
        signature, constexprs = {}, {}
        for i, param in enumerate(fn.params):
            value = values.get(param.name, param.default)
            if param.is_constexpr:
                signature[param.name] = "constexpr"
                constexprs[(i,)] = value
            else:
                signature[param.name] = _triton_type(value)
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        compiled = triton.compile(src, target=GPUTarget("cuda", self.arch, 32), options=options)
        usage = _resource_usage(compiled.asm["cubin"], compiled.metadata.name)
        dtype = next((t[1:] for t in signature.values() if t.startswith("*")), "")
        self.record.append(
            CompiledLaunch(
                kernel=compiled.metadata.name,
                arch=self.arch,
                grid=grid,
                dtype=dtype,
                num_warps=compiled.metadata.num_warps,
                registers=usage["REG"],
                shared_bytes=usage["SHARED"] + compiled.metadata.shared,
                local_bytes=usage["LOCAL"],
            )
        )


@contextmanager
def compile_launches(
    module: ModuleType, kernels: list[str], arch: int
) -> Iterator[list[CompiledLaunch]]:
    """Compile, instead of run, every launch of ``module.<kernel>`` for ``sm_<arch>``.

    Only the launched kernels are replaced: a ``@triton.jit`` helper they call
    (``find_seq_idx``) is read from the same module globals at compile time.
    """
    record: list[CompiledLaunch] = []
    saved = {name: getattr(module, name) for name in kernels}
    for name, kernel in saved.items():
        setattr(module, name, _CompileOnly(kernel, arch, record))
    try:
        yield record
    finally:
        for name, kernel in saved.items():
            setattr(module, name, kernel)


def compile_kernels(
    arch: int,
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int = 16,
) -> list[CompiledLaunch]:
    """Compile each kernel as its launcher calls it, for one attention shape and dtype.

    The paged write; the paged read's 2D launch (a prefill chunk beside a
    decode) and 3D launch with ``reduce_segments`` (decodes only), plain and
    with a sliding window and a soft cap (Gemma-2's sliding layers: both are
    compile-time constants, so a kernel of their own); and the contiguous
    FlashAttention kernel. The tensors are small and stay on the CPU: only
    their dtypes and strides reach the compiler.
    """
    from kernels import flash_attention, reshape_and_cache_flash, unified_attention

    seq_lens = torch.tensor([40, 70], dtype=torch.int32)
    num_blocks = 16
    kv_cache = torch.zeros(num_blocks, 2, block_size, num_kv_heads, head_size, dtype=dtype)
    block_table = torch.arange(2 * 8, dtype=torch.int32).view(2, 8) % num_blocks
    record: list[CompiledLaunch] = []

    with compile_launches(reshape_and_cache_flash, ["reshape_and_cache_kernel_flash"], arch) as r:
        key = torch.zeros(4, num_kv_heads, head_size, dtype=dtype)
        slots = torch.arange(4, dtype=torch.int64)
        reshape_and_cache_flash.reshape_and_cache_flash_triton(key, key, kv_cache, slots)
    record += r

    read = ["kernel_unified_attention", "reduce_segments"]
    variants = {"": ((-1, -1), 0.0), "window 4096, soft cap 50": ((4095, 0), 50.0)}
    with compile_launches(unified_attention, read, arch) as r:
        for variant, (window_size, softcap) in variants.items():
            for query_lens, seq_threshold_3D in (([9, 1], None), ([1, 1], 64)):
                q = torch.zeros(sum(query_lens), num_heads, head_size, dtype=dtype)
                qsl = torch.tensor([0, query_lens[0], sum(query_lens)], dtype=torch.int32)
                num_before = len(r)
                unified_attention.unified_attention_triton(
                    q,
                    kv_cache,
                    torch.empty_like(q),
                    qsl,
                    seq_lens,
                    max(query_lens),
                    int(seq_lens.max()),
                    block_table,
                    head_size**-0.5,
                    window_size=window_size,
                    softcap=softcap,
                    seq_threshold_3D=seq_threshold_3D,
                )
                r[num_before:] = [replace(x, variant=variant) for x in r[num_before:]]
    record += r

    with compile_launches(flash_attention, ["flash_attention_kernel"], arch) as r:
        q = torch.zeros(1, num_heads, 64, head_size, dtype=dtype)
        kv = torch.zeros(1, num_kv_heads, 64, head_size, dtype=dtype)
        flash_attention.flash_attention_triton(q, kv, kv)
    return record + r


def compile_moe_kernels(
    arch: int,
    dtype: torch.dtype,
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
    top_k: int,
    num_tokens: tuple[int, ...] = (8, 512),
) -> list[CompiledLaunch]:
    """Compile the MoE layer's two grouped GEMMs as ``fused_experts`` launches them.

    For each batch size (a decode batch and a prefill chunk, whose tiles
    differ: ``get_default_config``): the gate/up GEMM (``top_k`` rows per
    token, no router weight) and the down GEMM (one row per (token, k), the
    router's weight applied). The expert weights are one element expanded to
    their full shape: only their dtype and sizes reach the compiler.
    """
    from kernels import fused_moe

    n, k = 2 * intermediate_size, hidden_size
    w1 = torch.zeros(1, dtype=dtype).expand(num_experts, n, k)
    w2 = torch.zeros(1, dtype=dtype).expand(num_experts, k, intermediate_size)
    with compile_launches(fused_moe, ["fused_moe_kernel"], arch) as record:
        for m in num_tokens:
            config = fused_moe.get_default_config(m, num_experts, n, k, top_k, dtype)
            rows = m * top_k + num_experts * (config["BLOCK_SIZE_M"] - 1)
            sorted_ids = torch.zeros(rows, dtype=torch.int32)
            expert_ids = torch.zeros(-(-rows // config["BLOCK_SIZE_M"]), dtype=torch.int32)
            routing = (
                torch.zeros(m, top_k, dtype=torch.float32),
                sorted_ids,
                expert_ids,
                torch.zeros(1, dtype=torch.int32),
            )
            a1, c1 = torch.zeros(m, k, dtype=dtype), torch.zeros(m, top_k, n, dtype=dtype)
            fused_moe.invoke_fused_moe_triton_kernel(a1, w1, c1, *routing, False, top_k, config)
            a2 = torch.zeros(m * top_k, intermediate_size, dtype=dtype)
            c2 = torch.zeros(m, top_k, k, dtype=dtype)
            fused_moe.invoke_fused_moe_triton_kernel(a2, w2, c2, *routing, True, 1, config)
    return record
