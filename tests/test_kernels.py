"""The Triton kernels against their PyTorch references, and the engine on the Triton backend.

On a machine without a GPU the kernels run in Triton's interpreter
(``TRITON_INTERPRET=1``). Triton reads that switch once, when it is first
imported, and torch and transformers import it early: so this module turns it
on only if nothing has imported Triton yet (``pytest tests/test_kernels.py``).
In a whole-suite run Triton is already loaded for the GPU, and the tests here
run instead in one child pytest started with the switch on
(``test_kernels_in_triton_interpreter``); in the parent they show as skipped.

Tolerances: the paged write is a copy and must be exact; the attention kernels
accumulate in fp32 in a different order than SDPA (tiles of 32 keys, online
softmax) and must agree within atol = rtol = 1e-5 on fp32 inputs, 2e-3 on fp16
(2e-5 for the FlashAttention steps against naive attention, whose softmax sums
all keys at once).
"""

from __future__ import annotations

import os
import subprocess
import sys

if "triton" not in sys.modules:  # still in time: see the module docstring
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from kernels import unified_attention as ua
from kernels.flash_attention import blocked_attention, flash_attention_triton, naive_attention
from kernels.reshape_and_cache_flash import (
    reshape_and_cache_flash_torch,
    reshape_and_cache_flash_triton,
)
from kernels.triton_utils import HAS_TRITON, interpreter_active
from kernels.unified_attention import unified_attention_torch, unified_attention_triton
from tests.test_attention import build_case

INTERPRETED = HAS_TRITON and interpreter_active()
# Without the interpreter the kernels need a GPU (untested so far: no GPU here).
LIVE = INTERPRETED or (HAS_TRITON and torch.cuda.is_available())
DEVICE = "cpu" if INTERPRETED else "cuda"
live = pytest.mark.skipif(
    not LIVE, reason="runs in the interpreter child (test_kernels_in_triton_interpreter)"
)


@pytest.mark.skipif(LIVE or not HAS_TRITON, reason="kernels run in this process")
def test_kernels_in_triton_interpreter() -> None:
    """Run this file in a fresh pytest with TRITON_INTERPRET=1 set before any import."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-rfE"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]


# --- the paged write ------------------------------------------------------------------------


def _check_write(
    key: torch.Tensor,  # [num_tokens(+pad), num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens(+pad), num_kv_heads, head_size]
    slots: torch.Tensor,  # [num_tokens], -1 = padding
    num_blocks: int,
    block_size: int,
    gen: torch.Generator,
) -> None:
    """Into a random cache, the Triton write leaves exactly what the torch reference leaves."""
    num_kv_heads, head_size = key.shape[1], key.shape[2]
    cache = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_size, generator=gen)
    expected = cache.clone()
    reshape_and_cache_flash_torch(key, value, expected, slots)
    cache, key, value, slots = (t.to(DEVICE) for t in (cache, key, value, slots))
    reshape_and_cache_flash_triton(key, value, cache, slots)
    torch.testing.assert_close(cache.cpu(), expected, atol=0, rtol=0)


@live
@pytest.mark.parametrize(
    "num_tokens,num_kv_heads,head_size,block_size",
    [(7, 2, 64, 4), (5, 1, 128, 16), (3, 8, 16, 1)],
)
def test_reshape_and_cache_flash_triton_matches_torch(
    num_tokens: int, num_kv_heads: int, head_size: int, block_size: int
) -> None:
    """Same cache after the write, exactly: random slots, padding (-1), strided K/V."""
    gen = torch.Generator().manual_seed(num_tokens)
    num_blocks = num_tokens + 2
    # K and V as the attention layer hands them over: views into one fused qkv row.
    qkv = torch.randn(num_tokens + 1, 3 * num_kv_heads * head_size, generator=gen)
    key = qkv[:, : num_kv_heads * head_size].view(-1, num_kv_heads, head_size)
    value = qkv[:, 2 * num_kv_heads * head_size :].view(-1, num_kv_heads, head_size)
    # Block 0 is never handed out (vLLM's null block), so a stray write shows there.
    slots = torch.randperm((num_blocks - 1) * block_size, generator=gen)[:num_tokens] + block_size
    slots[1] = -1  # a padding token
    # The slot mapping is shorter than K/V: the extra row must not be written either.
    _check_write(key, value, slots, num_blocks, block_size, gen)


@live
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reshape_and_cache_flash_triton_random_shapes(seed: int) -> None:
    """Random token counts, heads (1..8), head sizes (64, 128), pages (1..32), padding."""
    gen = torch.Generator().manual_seed(200 + seed)
    rand = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))
    num_tokens, num_kv_heads = rand(1, 40), rand(1, 8)
    head_size, block_size = (64, 128)[rand(0, 1)], (1, 4, 16, 32)[rand(0, 3)]
    num_blocks = num_tokens // block_size + 3
    key = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen)
    value = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen)
    slots = torch.randperm((num_blocks - 1) * block_size, generator=gen)[:num_tokens] + block_size
    slots[torch.rand(num_tokens, generator=gen) < 0.2] = -1  # padding tokens
    _check_write(key, value, slots, num_blocks, block_size, gen)


# --- the paged read -------------------------------------------------------------------------

# (q_lens, seq_lens, (num_heads, num_kv_heads), head_size, block_size)
READ_CASES = {
    # mixed prefill + decode in one launch, partial last blocks, GQA 1
    "mixed": ([5, 1, 1, 3], [5, 17, 4, 19], (4, 4), 64, 4),
    # a single-token decode of a one-token sequence, GQA 8
    "one_token": ([1], [1], (8, 1), 128, 16),
    # decodes ending exactly on a block boundary and one past it, GQA 3
    "block_edges": ([1, 1, 1], [16, 32, 33], (6, 2), 128, 16),
    # a whole prompt and a later chunk with cached context before it, GQA 3
    "chunk": ([16, 7], [16, 23], (6, 2), 64, 4),
    # a prefill longer than one query block (BLOCK_Q = 16 rows / 1 head), beside decodes
    "long_prefill": ([1, 21, 1], [40, 50, 9], (2, 2), 64, 8),
    # GQA 8 with several query blocks per request (BLOCK_Q = 2)
    "gqa8_chunks": ([1, 9, 1, 2], [64, 40, 5, 2], (8, 1), 64, 16),
}


def _run_read(
    c: dict,
    q_lens: list[int],
    seq_lens: list[int],
    head_size: int,
    dtype: torch.dtype = torch.float32,
    tol: float = 1e-5,
    window: int | None = None,
    softcap: float = 0.0,
    triton_cache: torch.Tensor | None = None,
    **launch: int | None,
) -> torch.Tensor:
    """The Triton read against the torch reference on case ``c``; returns the Triton output.

    ``window`` / ``softcap``: vLLM's sliding window (as ``window_size``) and
    soft cap, for both. ``triton_cache``: another cache for the Triton read
    (stale pages), the reference reading ``c``'s.
    """
    scale = head_size**-0.5
    q, kv_cache = c["q"].to(dtype), c["kv_cache"].to(dtype)
    expected = torch.full_like(q, float("nan"))
    args = (c["qsl"], c["seq_lens"], max(q_lens), max(seq_lens), c["block_table"], scale)
    window_size = (window - 1, 0) if window is not None else (-1, -1)
    unified_attention_torch(q, kv_cache, expected, *args, window_size=window_size, softcap=softcap)
    if triton_cache is not None:
        kv_cache = triton_cache.to(dtype)
    q, kv_cache = q.to(DEVICE), kv_cache.to(DEVICE)
    out = torch.full_like(q, float("nan"))
    unified_attention_triton(
        q,
        kv_cache,
        out,
        *(a.to(DEVICE) if torch.is_tensor(a) else a for a in args),
        window_size=window_size,
        softcap=softcap,
        **launch,
    )
    torch.testing.assert_close(out.cpu(), expected, atol=tol, rtol=tol)
    return out.cpu()


@live
@pytest.mark.parametrize("name", list(READ_CASES))
def test_unified_attention_triton_matches_torch(name: str) -> None:
    q_lens, seq_lens, (num_heads, num_kv_heads), head_size, block_size = READ_CASES[name]
    c = build_case(q_lens, seq_lens, num_heads, num_kv_heads, head_size, block_size, seed=1)
    _run_read(c, q_lens, seq_lens, head_size)


# (q_lens, seq_lens, (num_heads, num_kv_heads), head_size, block_size, window, softcap)
WINDOW_CASES = {
    # a window shorter than a page, beside a chunk and decodes
    "mixed_window3": ([5, 1, 1, 3], [5, 17, 4, 19], (4, 4), 64, 4, 3, 0.0),
    # a later chunk whose first query's window starts past the first 32-key tile
    "chunk_past_first_tile_gqa3": ([7, 1], [80, 70], (6, 2), 64, 4, 20, 0.0),
    # a long prefill over several query blocks, window of one page, soft cap
    "long_prefill_softcap": ([1, 21, 1], [40, 50, 9], (2, 2), 64, 8, 8, 1.0),
    # the query alone (W = 1), GQA 8
    "window1_gqa8": ([1, 9, 1, 2], [64, 40, 5, 2], (8, 1), 64, 16, 1, 0.0),
    # soft cap without a window (Gemma-2's global layers)
    "softcap_only": ([16, 7], [16, 23], (6, 2), 64, 4, None, 1.0),
}


@live
@pytest.mark.parametrize("name", list(WINDOW_CASES))
def test_unified_attention_triton_window_and_softcap(name: str) -> None:
    """SLIDING_WINDOW and USE_SOFTCAP against the torch reference, 2D launch."""
    q_lens, seq_lens, (num_heads, num_kv_heads), head_size, block_size, window, softcap = (
        WINDOW_CASES[name]
    )
    c = build_case(q_lens, seq_lens, num_heads, num_kv_heads, head_size, block_size, seed=5)
    _run_read(c, q_lens, seq_lens, head_size, window=window, softcap=softcap)


@live
@pytest.mark.parametrize("softcap", [0.0, 1.0])
def test_split_softmax_with_window(softcap: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """3D launch: segments wholly before the window read nothing and weigh 0 in the merge."""
    seq_lens, window = [300, 17, 700], 50
    q_lens = [1] * len(seq_lens)
    c = build_case(q_lens, seq_lens, 4, 2, 64, 16, seed=6)
    reduce = _CountLaunches(ua.reduce_segments)
    monkeypatch.setattr(ua, "reduce_segments", reduce)
    _run_read(c, q_lens, seq_lens, 64, window=window, softcap=softcap, seq_threshold_3D=3)
    assert reduce.launches == 1


@live
@pytest.mark.parametrize("split", [False, True], ids=["2D", "3D"])
def test_unified_attention_triton_window_ignores_freed_pages(split: bool) -> None:
    """Pages wholly before every query's window may be freed and reused: NaN there
    must not reach the output (a tile can straddle them; V is zeroed there, as vLLM's)."""
    from tests.test_attention import free_pages_before_window

    q_lens = [1, 1, 1] if split else [1, 6, 1]
    seq_lens, window, block_size = [40, 30, 9], 8, 4
    c = build_case(q_lens, seq_lens, 4, 2, 64, block_size, seed=7)
    stale = free_pages_before_window(c, q_lens, seq_lens, window, block_size, float("nan"))
    launch = {"seq_threshold_3D": 3} if split else {}
    _run_read(c, q_lens, seq_lens, 64, window=window, triton_cache=stale, **launch)


@live
def test_unified_attention_triton_fp16() -> None:
    """Half precision: P is cast to V's dtype before P @ V, as on the GPU (atol = rtol = 2e-3).

    Not bf16: triton 3.9.0's interpreter gets bf16 ``tl.dot`` wrong (garbage
    of order 1e10 on a 16 x 16 product), so bf16 waits for a GPU.
    """
    q_lens, seq_lens, (num_heads, num_kv_heads), head_size, block_size = READ_CASES["mixed"]
    c = build_case(q_lens, seq_lens, num_heads, num_kv_heads, head_size, block_size, seed=2)
    _run_read(c, q_lens, seq_lens, head_size, dtype=torch.float16, tol=2e-3)


@live
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_unified_attention_triton_random_shapes(seed: int) -> None:
    """Random batches: each request a decode, a whole prompt or a chunk after context."""
    gen = torch.Generator().manual_seed(100 + seed)
    pick = lambda xs: xs[int(torch.randint(len(xs), (1,), generator=gen))]
    num_heads, num_kv_heads = pick([(3, 3), (6, 2), (8, 1)])
    head_size, block_size = pick([64, 128]), pick([2, 4, 16])
    q_lens, seq_lens = [], []
    for _ in range(int(torch.randint(1, 5, (1,), generator=gen))):
        seq_len = int(torch.randint(1, 48, (1,), generator=gen))
        q_len = pick([1, seq_len, max(1, seq_len // 3)])
        q_lens.append(q_len)
        seq_lens.append(seq_len)
    c = build_case(q_lens, seq_lens, num_heads, num_kv_heads, head_size, block_size, seed=seed)
    _run_read(c, q_lens, seq_lens, head_size)


@live
def test_unified_attention_triton_ignores_stale_cache_content() -> None:
    """Keys past seq_len in the last page (a freed request's leftovers) must not leak in."""
    q_lens, seq_lens, block_size = [1, 3], [6, 7], 4
    c = build_case(q_lens, seq_lens, 4, 2, 64, block_size, seed=1)
    outs = []
    for fill in (0.0, 1e4):
        cache = c["kv_cache"].clone()
        for r, s in enumerate(seq_lens):
            last = int(c["block_table"][r, (s - 1) // block_size])
            cache[last, :, (s - 1) % block_size + 1 :] = fill
        out = torch.empty_like(c["q"], device=DEVICE)
        unified_attention_triton(
            c["q"].to(DEVICE),
            cache.to(DEVICE),
            out,
            c["qsl"].to(DEVICE),
            c["seq_lens"].to(DEVICE),
            3,
            7,
            c["block_table"].to(DEVICE),
            0.125,
        )
        outs.append(out.cpu())
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)


class _CountLaunches:
    """Stands in for a kernel in its module and counts launches, passing each through."""

    def __init__(self, kernel: object) -> None:
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid: tuple[int, ...]) -> object:
        self.launches += 1
        return self.kernel[grid]  # type: ignore[index]


# (seq_lens of the decodes, (num_heads, num_kv_heads), head_size, block_size). With
# 16 segments of whole 16-key tiles: shorter than one tile, exactly one segment's
# worth, one key past a segment boundary, and long enough for several tiles per
# segment and an idle last segment.
SPLIT_CASES = {
    "short_and_long": ([1, 15, 16, 17, 300], (4, 4), 64, 16),
    "segment_edges_gqa3": ([256, 257, 513], (6, 2), 128, 16),
    "long_gqa8": ([700, 33], (8, 1), 64, 8),
}


@live
@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_split_softmax_decode_matches_torch(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The 3D launch + reduce_segments equals the reference, and the 2D launch."""
    seq_lens, (num_heads, num_kv_heads), head_size, block_size = SPLIT_CASES[name]
    q_lens = [1] * len(seq_lens)
    c = build_case(q_lens, seq_lens, num_heads, num_kv_heads, head_size, block_size, seed=3)
    reduce = _CountLaunches(ua.reduce_segments)
    monkeypatch.setattr(ua, "reduce_segments", reduce)
    split = _run_read(c, q_lens, seq_lens, head_size, seq_threshold_3D=len(seq_lens))
    assert reduce.launches == 1  # the split path ran
    whole = _run_read(c, q_lens, seq_lens, head_size)  # no threshold: the 2D launch
    assert reduce.launches == 1
    torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-5)


@live
def test_split_softmax_only_for_small_decode_only_batches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's rule: a prefill in the batch, or more requests than the threshold, means 2D."""
    reduce = _CountLaunches(ua.reduce_segments)
    monkeypatch.setattr(ua, "reduce_segments", reduce)
    for q_lens, seq_lens, threshold, split in [
        ([1, 1, 1], [20, 40, 9], 2, False),  # three decodes, threshold two
        ([1, 4, 1], [20, 40, 9], 8, False),  # a prefill chunk among them
        ([1, 1, 1], [20, 40, 9], 3, True),
    ]:
        c = build_case(q_lens, seq_lens, 4, 2, 64, 4, seed=4)
        before = reduce.launches
        _run_read(c, q_lens, seq_lens, 64, seq_threshold_3D=threshold)
        assert reduce.launches - before == int(split), (q_lens, threshold)


def test_triton_backend_names_its_launch() -> None:
    """The unified_attention span says which launch the step takes: vLLM's rule, per step."""
    from tracevllm.attention.backends.abstract import AttentionMetadata
    from tracevllm.attention.backends.triton_attn import TritonAttentionImpl

    impl = TritonAttentionImpl(num_heads=9, head_size=64, scale=0.125, num_kv_heads=3)
    assert impl.seq_threshold_3D == 128 // 3

    def metadata(query_lens: list[int]) -> AttentionMetadata:
        n = len(query_lens)
        ints = torch.zeros(n, dtype=torch.int32)
        return AttentionMetadata(sum(query_lens), max(query_lens), ints, 8, ints, ints, ints)

    assert "3D" in impl.launch_name(metadata([1] * 42))
    assert "2D" in impl.launch_name(metadata([1] * 43))
    assert "2D" in impl.launch_name(metadata([1, 5]))


@live
def test_split_softmax_fp16() -> None:
    seq_lens, (num_heads, num_kv_heads), head_size, block_size = SPLIT_CASES["short_and_long"]
    q_lens = [1] * len(seq_lens)
    c = build_case(q_lens, seq_lens, num_heads, num_kv_heads, head_size, block_size, seed=5)
    _run_read(c, q_lens, seq_lens, head_size, torch.float16, 2e-3, seq_threshold_3D=8)


# --- FlashAttention from PyTorch to Triton --------------------------------------------------

# (batch, num_heads, num_kv_heads, q_len, kv_len, head_size, causal)
FLASH_CASES = {
    "causal_mha": (2, 2, 2, 37, 37, 64, True),  # q_len not a multiple of the block
    "chunk_gqa3": (1, 6, 2, 20, 50, 128, True),  # queries after 30 cached positions
    "bidirectional_gqa8": (1, 8, 1, 5, 70, 64, False),
    "decode_small_head": (1, 3, 3, 1, 33, 16, True),  # head_size 16: padding-free minimum
}


@live
@pytest.mark.parametrize("name", list(FLASH_CASES))
def test_flash_attention_steps_match_naive(name: str) -> None:
    batch, num_heads, num_kv_heads, q_len, kv_len, head_size, causal = FLASH_CASES[name]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, num_heads, q_len, head_size, generator=gen)
    k = torch.randn(batch, num_kv_heads, kv_len, head_size, generator=gen)
    v = torch.randn(batch, num_kv_heads, kv_len, head_size, generator=gen)
    expected = naive_attention(q, k, v, causal)
    # naive_attention itself against SDPA where SDPA's mask means the same thing.
    if not causal or q_len == kv_len:
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=causal, enable_gqa=True
        )
        torch.testing.assert_close(expected, sdpa, atol=2e-5, rtol=2e-5)
    blocked = blocked_attention(q, k, v, causal, block_m=16, block_n=16)
    torch.testing.assert_close(blocked, expected, atol=2e-5, rtol=2e-5)
    q, k, v = q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)
    out = flash_attention_triton(q, k, v, causal, block_m=16, block_n=16)
    torch.testing.assert_close(out.cpu(), expected, atol=2e-5, rtol=2e-5)


@live
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_flash_attention_random_shapes(seed: int) -> None:
    """Random lengths (queries after cached keys, or bidirectional), GQA 1/3/8, head 64/128."""
    gen = torch.Generator().manual_seed(300 + seed)
    rand = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))
    num_kv_heads, group = rand(1, 2), (1, 3, 8)[rand(0, 2)]
    head_size, causal = (64, 128)[rand(0, 1)], bool(rand(0, 1))
    q_len = rand(1, 40)
    kv_len = q_len + rand(0, 30) if causal else rand(1, 70)
    shape = (rand(1, 2), num_kv_heads * group)
    q = torch.randn(*shape, q_len, head_size, generator=gen)
    k = torch.randn(shape[0], num_kv_heads, kv_len, head_size, generator=gen)
    v = torch.randn(shape[0], num_kv_heads, kv_len, head_size, generator=gen)
    expected = naive_attention(q, k, v, causal)
    out = flash_attention_triton(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), causal)
    torch.testing.assert_close(out.cpu(), expected, atol=2e-5, rtol=2e-5)


# --- compiled for real GPUs, on this machine ------------------------------------------------

compiles = pytest.mark.skipif(
    INTERPRETED or not HAS_TRITON, reason="compiling needs Triton's compiler, not the interpreter"
)


@compiles
@pytest.mark.parametrize("arch", [80, 90])
def test_kernels_compile_for_gpus_and_fit(
    arch: int, tmp_path: os.PathLike, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every launch compiles to a cubin for sm_80 / sm_90, fits one SM, and does not spill.

    The interpreter never runs Triton's compiler; this does, with each
    launcher's own arguments, at a Llama-3-8B layer's shape (32 query heads, 8
    KV heads, head size 128), in fp16, bf16 and fp32, the paged read also with
    a sliding window and a soft cap. No GPU needed (kernels/aot.py).
    """
    from kernels.aot import MAX_SHARED_BYTES_PER_PROGRAM, compile_kernels

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compile, do not reuse
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        launches = compile_kernels(arch, dtype, num_heads=32, num_kv_heads=8, head_size=128)
        window = "window 4096, soft cap 50"
        assert [(x.kernel, len(x.grid), x.variant) for x in launches] == [
            ("reshape_and_cache_kernel_flash", 2, ""),
            ("kernel_unified_attention", 2, ""),
            ("kernel_unified_attention", 3, ""),
            ("reduce_segments", 2, ""),
            ("kernel_unified_attention", 2, window),
            ("kernel_unified_attention", 3, window),
            ("reduce_segments", 2, window),
            ("flash_attention_kernel", 2, ""),
        ]
        for x in launches:
            assert x.shared_bytes <= MAX_SHARED_BYTES_PER_PROGRAM[arch], x
            assert x.local_bytes == 0, x  # no register spills
            assert x.programs_per_sm() >= 1, x


def test_programs_per_sm() -> None:
    """The occupancy arithmetic: registers, shared memory and the per-SM cap, the tightest wins."""
    from kernels.aot import CompiledLaunch

    def launch(registers: int, shared: int, arch: int = 80) -> CompiledLaunch:
        return CompiledLaunch("k", arch, (1,), "fp16", 4, registers, shared, 0)

    assert launch(128, 0).programs_per_sm() == 4  # 65536 / (128 * 128 threads)
    assert launch(121, 0).programs_per_sm() == 4  # rounded up to 128 per thread
    assert launch(32, 40 * 1024).programs_per_sm() == 4  # 164 KiB / 40 KiB
    assert launch(16, 0).programs_per_sm() == 32  # the cap on resident programs
    assert launch(32, 176 * 1024).programs_per_sm() == 0  # over an A100's 163 KiB
    assert launch(32, 176 * 1024, arch=90).programs_per_sm() == 1


# --- the engine on the Triton backend -------------------------------------------------------


def test_triton_backend_needs_the_interpreter_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from tracevllm import _custom_ops as ops
    from tracevllm.attention.selector import get_attn_backend

    assert get_attn_backend(None, "cpu").get_name() in ("CPU_ATTN", "TORCH_ATTN")
    monkeypatch.setattr(ops, "interpreter_active", lambda: False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1" if HAS_TRITON else "needs Triton"):
        get_attn_backend("triton", "cpu")
    monkeypatch.setattr(ops, "interpreter_active", lambda: True)
    if HAS_TRITON:
        assert get_attn_backend("triton", "cpu").get_name() == "TRITON_ATTN"


@live
def test_triton_backend_generates_the_torch_backends_tokens(
    tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy tokens, token for token, through chunked prefill, prefix hits and decodes.

    The decode-only steps (three requests, under the split-softmax threshold)
    take the 3D launch; the steps with a prefill chunk the 2D one.
    """
    from tracevllm import LLM, SamplingParams

    reduce = _CountLaunches(ua.reduce_segments)
    monkeypatch.setattr(ua, "reduce_segments", reduce)

    prompts = [
        "The capital of France is",
        "The capital of France is Paris, and the capital of Germany is",  # prefix hit
        "A paged KV cache stores keys and values in fixed-size blocks of tokens",
    ]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    tokens = {}
    for backend in ("torch", "triton"):
        # Small pages and a small token budget: prompts straddle pages and are
        # prefilled in chunks beside other requests' decodes.
        llm = LLM(
            model=tiny_model_dir,
            attention_backend=backend,
            enable_multiprocessing=False,
            block_size=4,
            max_num_batched_tokens=12,
        )
        outputs = llm.generate(prompts, params)
        tokens[backend] = [o.outputs[0].token_ids for o in outputs]
    assert tokens["triton"] == tokens["torch"]
    assert reduce.launches > 0
