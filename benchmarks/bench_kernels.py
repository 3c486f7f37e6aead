"""The Triton attention kernels on a CUDA GPU, against PyTorch's SDPA on the same shapes.

- Paged decode read (``unified_attention_triton``, one query token per request),
  in its 2D launch and its 3D split-softmax launch (``reduce_segments``):
  achieved memory bandwidth in GB/s and as a share of the device's peak. A
  decode reads every cached K and V once and does little math on them, so
  bandwidth is its roofline. SDPA reads the same K/V from a contiguous tensor
  (no page table), which is what the paged layout costs us against.
- Prefill (whole prompts, causal): TFLOP/s of ``flash_attention_triton``
  (contiguous) and ``unified_attention_triton`` (paged), against SDPA.

Each row also prints the largest difference from SDPA's output, so a first run
on a new GPU doubles as a correctness check. Times are triton.testing.do_bench
medians. On a machine without CUDA it says so and exits 0.

Run: ``make bench-kernels`` (or ``python benchmarks/bench_kernels.py``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

# Peak HBM bandwidth (bytes/s) and dense bf16 tensor-core peak (FLOP/s) by
# device name, from the vendors' data sheets. The first name contained in the
# device's name wins, so a name that contains another (GH200, H200) comes first.
PEAKS: list[tuple[str, float, float]] = [
    ("GH200", 4.0e12, 989e12),
    ("H200", 4.8e12, 989e12),
    ("H100 NVL", 3.9e12, 835e12),
    ("H100 PCIe", 2.0e12, 756e12),
    ("H100", 3.35e12, 989e12),  # SXM
    ("A100-SXM4-80GB", 2.039e12, 312e12),
    ("A100 80GB PCIe", 1.935e12, 312e12),
    ("A100", 1.555e12, 312e12),  # 40GB
    ("L40S", 0.864e12, 362e12),
    ("L40", 0.864e12, 181e12),
    ("L4", 0.3e12, 121e12),
    ("A10G", 0.6e12, 70e12),
    ("A10", 0.6e12, 125e12),
    ("RTX 4090", 1.008e12, 165e12),
    ("RTX 3090", 0.936e12, 71e12),
    ("T4", 0.32e12, 65e12),
]


# The attention shape of a Llama-3-8B-like layer, and the engine's page size.
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 8, 128, 16
DEVICE = "cuda"


def device_peaks(name: str) -> tuple[float | None, float | None]:
    """(bytes/s, FLOP/s) for the device, or None where it is not known."""
    for key, bandwidth, flops in PEAKS:
        if key in name:
            return bandwidth, flops
    # Not in the table: derive bandwidth from the memory clock where torch exposes it
    # (double data rate, so two transfers per clock).
    props = torch.cuda.get_device_properties(0)
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    bandwidth = 2 * clock_khz * 1e3 * bus_bits / 8 if clock_khz and bus_bits else None
    return bandwidth, None


def bench(fn: Callable[[], object]) -> float:
    """Median seconds per call."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") / 1e3


def paged_case(
    seq_lens: list[int],
    query_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
) -> dict:
    """A batch in the paged layout (shuffled pages) and the same K/V contiguous, for SDPA."""
    dev = DEVICE
    num_reqs = len(seq_lens)
    max_len = max(seq_lens)
    blocks_per_req = -(-max_len // block_size)
    num_blocks = num_reqs * blocks_per_req + 1
    # [num_reqs, max_len, num_kv_heads, head_size] each
    key = torch.randn(num_reqs, max_len, num_kv_heads, head_size, device=dev, dtype=dtype)
    value = torch.randn_like(key)
    kv_cache = torch.empty(
        num_blocks, 2, block_size, num_kv_heads, head_size, device=dev, dtype=dtype
    )
    perm = torch.randperm(num_blocks - 1, device=dev).to(torch.int32) + 1
    block_table = perm[: num_reqs * blocks_per_req].view(num_reqs, blocks_per_req)
    pad = blocks_per_req * block_size - max_len
    # [num_reqs, blocks_per_req, block_size, num_kv_heads, head_size]
    kv_cache[block_table.long(), 0] = F.pad(key, (0, 0, 0, 0, 0, pad)).view(
        num_reqs, blocks_per_req, block_size, num_kv_heads, head_size
    )
    kv_cache[block_table.long(), 1] = F.pad(value, (0, 0, 0, 0, 0, pad)).view(
        num_reqs, blocks_per_req, block_size, num_kv_heads, head_size
    )
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, num_heads, head_size, device=dev, dtype=dtype)
    qsl = torch.zeros(num_reqs + 1, dtype=torch.int32, device=dev)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens, device=dev), 0)
    return dict(
        q=q,
        key=key,
        value=value,
        kv_cache=kv_cache,
        block_table=block_table,
        qsl=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
    )


def bench_decode(
    num_reqs: int, seq_len: int, dtype: torch.dtype, peak_bw: float | None
) -> list[list[str]]:
    from kernels.unified_attention import unified_attention_triton

    num_heads, num_kv_heads, head_size, block_size = NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE
    c = paged_case(
        [seq_len] * num_reqs, [1] * num_reqs, num_heads, num_kv_heads, head_size, block_size, dtype
    )
    scale = head_size**-0.5
    out = torch.empty_like(c["q"])

    def launch(seq_threshold_3D: int | None) -> Callable[[], None]:
        def triton_paged() -> None:
            unified_attention_triton(
                c["q"], c["kv_cache"], out, c["qsl"], c["seq_lens"], 1, seq_len,
                c["block_table"], scale, seq_threshold_3D=seq_threshold_3D,
            )  # fmt: skip

        return triton_paged

    # SDPA: [num_reqs, num_heads, 1, head_size] against [num_reqs, num_kv_heads, seq_len, head_size]
    sq = c["q"].view(num_reqs, num_heads, 1, head_size)
    sk, sv = c["key"].transpose(1, 2), c["value"].transpose(1, 2)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(sq, sk, sv, scale=scale, enable_gqa=True)

    ref = sdpa().squeeze(2).float()
    elem = c["q"].element_size()
    # Every cached K and V once, plus the queries in and the outputs out.
    nbytes = num_reqs * seq_len * 2 * num_kv_heads * head_size * elem + 2 * c["q"].numel() * elem
    rows = []
    candidates = (
        ("triton paged, 2D", launch(None)),
        ("triton paged, 3D split-softmax", launch(num_reqs)),
        ("torch SDPA (contiguous)", sdpa),
    )
    for name, fn in candidates:
        out.fill_(float("nan"))
        result = fn()
        got = out if result is None else result.squeeze(2)
        err = (got.view(num_reqs, num_heads, head_size).float() - ref).abs().max()
        t = bench(fn)
        gbs = nbytes / t / 1e9
        share = f"{100 * nbytes / t / peak_bw:.0f}%" if peak_bw else "n/a"
        rows.append(
            [name, f"{num_reqs} x {seq_len}", f"{t * 1e6:.1f}", f"{gbs:.0f}", share, f"{err:.1e}"]
        )
    return rows


def bench_prefill(
    batch: int, seq_len: int, dtype: torch.dtype, peak_flops: float | None
) -> list[list[str]]:
    from kernels.flash_attention import flash_attention_triton
    from kernels.unified_attention import unified_attention_triton

    num_heads, num_kv_heads, head_size, block_size = NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE
    c = paged_case(
        [seq_len] * batch, [seq_len] * batch, num_heads, num_kv_heads, head_size, block_size, dtype
    )
    scale = head_size**-0.5
    out = torch.empty_like(c["q"])
    # [batch, heads, seq_len, head_size] views of the same data
    sq = c["q"].view(batch, seq_len, num_heads, head_size).transpose(1, 2)
    sk, sv = c["key"].transpose(1, 2), c["value"].transpose(1, 2)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(
            sq, sk, sv, is_causal=True, scale=scale, enable_gqa=True
        )

    def flash() -> torch.Tensor:
        return flash_attention_triton(sq, sk, sv, causal=True, scale=scale)

    def triton_paged() -> None:
        unified_attention_triton(
            c["q"], c["kv_cache"], out, c["qsl"], c["seq_lens"], seq_len, seq_len,
            c["block_table"], scale,
        )  # fmt: skip

    ref = sdpa().float()
    triton_paged()
    paged_err = out.view(batch, seq_len, num_heads, head_size).transpose(1, 2).float() - ref
    errs = {
        "triton flash (contiguous)": (flash().float() - ref).abs().max(),
        "triton paged": paged_err.abs().max(),
        "torch SDPA (contiguous)": torch.tensor(0.0),
    }
    # QK^T and PV: 2 matmuls x 2 FLOP per multiply-add, half the square (causal).
    flops = 4 * batch * num_heads * seq_len * seq_len * head_size / 2
    rows = []
    for name, fn in (
        ("triton flash (contiguous)", flash),
        ("triton paged", triton_paged),
        ("torch SDPA (contiguous)", sdpa),
    ):
        t = bench(fn)
        share = f"{100 * flops / t / peak_flops:.0f}%" if peak_flops else "n/a"
        rows.append(
            [
                name,
                f"{batch} x {seq_len}",
                f"{t * 1e3:.2f}",
                f"{flops / t / 1e12:.1f}",
                share,
                f"{errs[name]:.1e}",
            ]
        )
    return rows


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print(f"\n{title}")
    for r in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in
                        enumerate(zip(r, widths))))  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--quick", action="store_true", help="one shape per table")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench-kernels needs a CUDA GPU: none here, nothing to measure.")
        print(
            "(On CPU the kernels are tested in Triton's interpreter: pytest tests/test_kernels.py)"
        )
        return 0
    try:
        import triton
    except ImportError:
        print("bench-kernels needs Triton: pip install 'tracevllm[triton]'.")
        return 0

    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name(0)
    peak_bw, peak_flops = device_peaks(name)
    print(f"device: {name}; torch {torch.__version__}, triton {triton.__version__}; {args.dtype}")
    print(
        f"peak HBM bandwidth: {peak_bw / 1e9:.0f} GB/s" if peak_bw else "peak bandwidth: unknown",
        f"| peak dense {args.dtype}: {peak_flops / 1e12:.0f} TFLOP/s"
        if peak_flops
        else "| peak FLOP/s: unknown",
    )
    print(
        f"shapes: {NUM_HEADS} query heads, {NUM_KV_HEADS} KV heads, head_size {HEAD_SIZE}, "
        f"block_size {BLOCK_SIZE}"
    )

    # vLLM takes the 3D launch below MIN_LAUNCH_GRID_SIZE_2D // num_kv_heads = 16
    # requests here; both launches are timed at every size.
    decode_shapes = (
        [(4, 16384), (64, 4096)]
        if args.quick
        else [(1, 32768), (4, 16384), (16, 1024), (64, 4096), (128, 8192)]
    )
    rows = [r for s in decode_shapes for r in bench_decode(*s, dtype, peak_bw)]
    header = ["decode read", "reqs x ctx", "us", "GB/s", "% peak BW", "max |diff|"]
    print_table("Paged decode read (1 query token per request)", header, rows)

    prefill_shapes = [(1, 4096)] if args.quick else [(4, 1024), (1, 4096), (1, 16384)]
    rows = [r for s in prefill_shapes for r in bench_prefill(*s, dtype, peak_flops)]
    header = ["prefill", "batch x len", "ms", "TFLOP/s", "% peak", "max |diff|"]
    print_table("Prefill, causal, whole prompts", header, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
