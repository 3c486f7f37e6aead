"""The mixture-of-experts pieces: routing, grouping by expert, the kernel, the layer.

The Triton kernel runs in Triton's interpreter on a machine without a GPU,
as in tests/test_kernels.py (whose module docstring explains the switch and
the child pytest that a whole-suite run falls back on). Compiling for
sm_80 / sm_90 runs in a child process without the interpreter.

Tolerances: the grouping (``moe_align_block_size``) and the router's choice
are exact; the kernel accumulates in fp32 like the reference, in another
order, so fp32 agrees within 1e-5 and fp16 within 2e-3.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

if "triton" not in sys.modules:  # still in time: see tests/test_kernels.py
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import torch.nn.functional as F

from kernels.fused_moe import fused_moe_kernel_torch, invoke_fused_moe_triton_kernel
from kernels.triton_utils import HAS_TRITON, interpreter_active
from tracevllm import _custom_ops as ops
from tracevllm.model_executor.layers.fused_moe.fused_moe import fused_experts
from tracevllm.model_executor.layers.fused_moe.moe_align_block_size import moe_align_block_size
from tracevllm.model_executor.layers.fused_moe.router.fused_topk_router import fused_topk

INTERPRETED = HAS_TRITON and interpreter_active()
LIVE = INTERPRETED or (HAS_TRITON and torch.cuda.is_available())
DEVICE = "cpu" if INTERPRETED else "cuda"
live = pytest.mark.skipif(
    not LIVE, reason="runs in the interpreter child (test_fused_moe_in_triton_interpreter)"
)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(LIVE or not HAS_TRITON, reason="kernels run in this process")
def test_fused_moe_in_triton_interpreter() -> None:
    """Run this file in a fresh pytest with TRITON_INTERPRET=1 set before any import."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-rfE"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]


# --- helpers --------------------------------------------------------------------------------


def random_routing(
    num_tokens: int, num_experts: int, top_k: int, gen: torch.Generator, *, idle: int, busy: int
) -> torch.Tensor:
    """``[num_tokens, top_k]`` distinct experts a token: ``idle`` never chosen, ``busy`` always."""
    others = [e for e in range(num_experts) if e not in (idle, busy)]
    rows = []
    for _ in range(num_tokens):
        pick = torch.randperm(len(others), generator=gen)[: top_k - 1].tolist()
        row = [busy] + [others[i] for i in pick]
        rows.append([row[i] for i in torch.randperm(top_k, generator=gen).tolist()])
    return torch.tensor(rows, dtype=torch.int32)


def dense_moe(
    x: torch.Tensor,  # [num_tokens, hidden]
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    w13: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]
    w2: torch.Tensor,  # [num_experts, hidden, intermediate]
    top_k: int,
    renormalize: bool,
) -> torch.Tensor:
    """The layer's meaning, one token and one expert at a time, in fp64 (HF's loop, unbatched)."""
    intermediate = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        probs = torch.softmax(router_logits[t].double(), dim=-1)
        weights, experts = torch.topk(probs, top_k)
        if renormalize:
            weights = weights / weights.sum()
        for weight, e in zip(weights.tolist(), experts.tolist(), strict=True):
            gate_up = w13[e].double() @ x[t].double()  # [2 * intermediate]
            act = F.silu(gate_up[:intermediate]) * gate_up[intermediate:]
            out[t] += weight * (w2[e].double() @ act)
    return out.to(x.dtype)


# --- the router -----------------------------------------------------------------------------


def test_fused_topk_renormalises_as_computed_by_hand() -> None:
    """Logits [1, 2, 0.5, 3], top 2: experts 3 and 1, weights e^3 : e^2 (renormalised) or p."""
    logits = torch.tensor([[1.0, 2.0, 0.5, 3.0], [0.0, 0.0, 5.0, -1.0]])
    x = torch.zeros(2, 8)
    weights, ids, token_expert_indices = fused_topk(x, logits, 2, renormalize=True)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert ids[0].tolist() == [3, 1] and ids[1, 0] == 2
    e = math.exp
    expected = [e(3) / (e(3) + e(2)), e(2) / (e(3) + e(2))]  # sigmoid(1), sigmoid(-1)
    torch.testing.assert_close(weights[0], torch.tensor(expected), rtol=1e-6, atol=0)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2), rtol=1e-6, atol=0)

    weights, ids, _ = fused_topk(x, logits, 2, renormalize=False)
    z = e(1) + e(2) + e(0.5) + e(3)
    torch.testing.assert_close(weights[0], torch.tensor([e(3) / z, e(2) / z]), rtol=1e-6, atol=0)
    assert float(weights[0].sum()) < 0.95  # what renormalising restores to 1
    # As the CUDA kernel: the (token, k) pair's row when the pairs are laid out k-major.
    assert token_expert_indices.tolist() == [[0, 2], [1, 3]]

    weights, ids, _ = fused_topk(x, logits, 1, renormalize=False, scoring_func="sigmoid")
    torch.testing.assert_close(weights[:, 0], torch.sigmoid(torch.tensor([3.0, 5.0])))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"topk": 5}, "topk must be an int in \\[1, 4\\]"),
        ({"topk": 0}, "topk must be an int"),
        ({"topk": True}, "topk must be an int"),
        ({"topk": 2, "scoring_func": "softplus"}, "Unsupported scoring function: softplus"),
    ],
)
def test_fused_topk_refuses(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fused_topk(torch.zeros(3, 8), torch.zeros(3, 4), renormalize=True, **kwargs)
    with pytest.raises(ValueError, match="Number of tokens mismatch"):
        fused_topk(torch.zeros(2, 8), torch.zeros(3, 4), 2, True)


# --- grouping by expert ---------------------------------------------------------------------


def test_moe_align_block_size_example() -> None:
    """vLLM's docstring example (experts numbered from 0): three rows each, one padding each."""
    topk_ids = torch.tensor([[1, 2, 3], [0, 1, 3], [0, 2, 3], [0, 1, 2]])
    sorted_ids, expert_ids, num_post_pad = moe_align_block_size(topk_ids, 4, 4)
    assert num_post_pad.tolist() == [16]
    assert sorted_ids[:16].tolist() == [3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 11, 12, 2, 5, 8, 12]
    assert (sorted_ids[16:] == 12).all()  # spare room, padding too
    assert expert_ids.tolist()[:4] == [0, 1, 2, 3] and (expert_ids[4:] == -1).all()


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("seed", [0, 1])
def test_moe_align_block_size_counts_tokens_per_expert(block_size: int, seed: int) -> None:
    """Each expert's run holds exactly its rows, in order, padded to whole blocks.

    Against a count made one row at a time: an idle expert gets no block, the
    expert every token picks gets one row per token.
    """
    gen = torch.Generator().manual_seed(seed)
    num_tokens, num_experts, top_k = 13, 6, 3
    topk_ids = random_routing(num_tokens, num_experts, top_k, gen, idle=2, busy=4)
    sorted_ids, expert_ids, num_post_pad = moe_align_block_size(topk_ids, block_size, num_experts)

    rows_of: dict[int, list[int]] = {e: [] for e in range(num_experts)}
    for row, e in enumerate(topk_ids.flatten().tolist()):
        rows_of[e].append(row)
    assert len(rows_of[2]) == 0 and len(rows_of[4]) == num_tokens
    expected_sorted, expected_experts = [], []
    for e, rows in rows_of.items():
        blocks = -(-len(rows) // block_size)
        expected_sorted += rows + [topk_ids.numel()] * (blocks * block_size - len(rows))
        expected_experts += [e] * blocks
    n = int(num_post_pad)
    assert n == len(expected_sorted)
    assert sorted_ids[:n].tolist() == expected_sorted
    assert expert_ids[: n // block_size].tolist() == expected_experts
    # Each block's real rows, counted by its expert: the tokens per expert.
    counts = torch.zeros(num_experts, dtype=torch.long)
    real = sorted_ids[:n].view(-1, block_size) < topk_ids.numel()
    counts.index_add_(0, expert_ids[: n // block_size].long(), real.sum(1))
    assert counts.tolist() == [len(rows_of[e]) for e in range(num_experts)]


def test_moe_align_block_size_fewer_rows_than_experts() -> None:
    """One token, top 2 of 64 experts: vLLM's tighter bound (rows * block_size) sizes the output."""
    sorted_ids, expert_ids, num_post_pad = moe_align_block_size(torch.tensor([[63, 5]]), 16, 64)
    assert sorted_ids.shape == (32,) and expert_ids.shape == (2,)
    assert int(num_post_pad) == 32 and expert_ids.tolist() == [5, 63]
    assert sorted_ids[0] == 1 and sorted_ids[16] == 0


# --- the kernel -----------------------------------------------------------------------------

# (num_tokens, num_experts, top_k, hidden, intermediate): block sizes 16 and 32
# (get_default_config), K and N not multiples of the tiles, several blocks per expert.
KERNEL_CASES = {
    "decode": (3, 8, 2, 64, 32),
    "small_batch": (20, 6, 2, 48, 40),
    "several_blocks_per_expert": (40, 4, 3, 72, 24),
    "top1": (9, 5, 1, 16, 16),
}


def _weights(
    num_experts: int, hidden: int, intermediate: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, intermediate, generator=gen) / intermediate**0.5
    return w13, w2


def _launch_both(
    A: torch.Tensor,
    B: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    mul_routed_weight: bool,
    top_k: int,
    out_top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One grouped GEMM through the reference and the kernel, each into a NaN-filled C."""
    config = ops.get_default_config(
        topk_ids.shape[0], num_experts, B.shape[1], B.shape[2], out_top_k, A.dtype
    )
    routing = moe_align_block_size(topk_ids, config["BLOCK_SIZE_M"], num_experts)
    shape = (topk_ids.shape[0], out_top_k, B.shape[1])
    expected = torch.full(shape, float("nan"), dtype=A.dtype)
    fused_moe_kernel_torch(A, B, expected, topk_weights, *routing, mul_routed_weight, top_k, config)
    out = torch.full(shape, float("nan"), dtype=A.dtype, device=DEVICE)
    args = [t.to(DEVICE) for t in (A, B, out, topk_weights, *routing)]
    invoke_fused_moe_triton_kernel(*args, mul_routed_weight, top_k, config)
    return out.cpu(), expected


@live
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_fused_moe_kernel_matches_torch(name: str, dtype: torch.dtype) -> None:
    """Both GEMMs of the layer, kernel against reference, on a routing with an idle expert
    (never chosen) and a busy one (chosen by every token); every (token, k) row written."""
    num_tokens, num_experts, top_k, hidden, intermediate = KERNEL_CASES[name]
    gen = torch.Generator().manual_seed(num_tokens)
    topk_ids = random_routing(num_tokens, num_experts, top_k, gen, idle=0, busy=num_experts - 1)
    topk_weights = torch.rand(num_tokens, top_k, generator=gen)
    w13, w2 = (w.to(dtype) for w in _weights(num_experts, hidden, intermediate, gen))
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-3

    out, expected = _launch_both(x, w13, topk_weights, topk_ids, num_experts, False, top_k, top_k)
    assert not expected.isnan().any()
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    # The down projection: one row per (token, k), each scaled by its router weight.
    a2 = torch.randn(num_tokens * top_k, intermediate, generator=gen).to(dtype)
    out, expected = _launch_both(a2, w2, topk_weights, topk_ids, num_experts, True, 1, top_k)
    assert not expected.isnan().any()
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


@live
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fused_experts_triton_matches_torch_on_random_routings(seed: int) -> None:
    """The whole expert computation, routed by ``fused_topk`` on random logits; one expert's
    logit pushed down so no token picks it, one pushed up so every token does."""
    gen = torch.Generator().manual_seed(10 + seed)
    rand = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))
    num_tokens, num_experts = rand(1, 40), rand(3, 8)
    top_k, hidden, intermediate = rand(1, min(3, num_experts - 1)), 16 * rand(1, 4), 8 * rand(1, 6)
    x = torch.randn(num_tokens, hidden, generator=gen)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    logits[:, 0] -= 100.0
    logits[:, -1] += 100.0
    w13, w2 = _weights(num_experts, hidden, intermediate, gen)
    topk_weights, topk_ids, _ = fused_topk(x, logits, top_k, renormalize=True)
    counts = torch.bincount(topk_ids.flatten(), minlength=num_experts)
    assert counts[0] == 0 and counts[-1] == num_tokens
    expected = fused_experts(x, w13, w2, topk_weights, topk_ids, backend="torch")
    out = fused_experts(
        *(t.to(DEVICE) for t in (x, w13, w2, topk_weights, topk_ids)), backend="triton"
    )
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("renormalize", [True, False])
def test_fused_experts_matches_a_dense_per_token_loop(renormalize: bool) -> None:
    """The grouped path (torch reference) against the loop over tokens and their experts."""
    gen = torch.Generator().manual_seed(3)
    num_tokens, num_experts, top_k, hidden, intermediate = 37, 8, 2, 32, 24
    x = torch.randn(num_tokens, hidden, generator=gen)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    w13, w2 = _weights(num_experts, hidden, intermediate, gen)
    topk_weights, topk_ids, _ = fused_topk(x, logits, top_k, renormalize)
    out = fused_experts(x, w13, w2, topk_weights, topk_ids, backend="torch")
    expected = dense_moe(x, logits, w13, w2, top_k, renormalize)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


# --- compiled for real GPUs, on this machine ------------------------------------------------

_COMPILE = """
import torch
from kernels.aot import MAX_SHARED_BYTES_PER_PROGRAM, compile_moe_kernels
for arch in (80, 90):
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        # Qwen3-30B-A3B's experts: 128 of them, top 8, hidden 2048, intermediate 768.
        launches = compile_moe_kernels(arch, dtype, 128, 2048, 768, 8)
        assert [x.kernel for x in launches] == ["fused_moe_kernel"] * 4, launches
        for x in launches:
            assert x.shared_bytes <= MAX_SHARED_BYTES_PER_PROGRAM[arch], x
            assert x.local_bytes == 0, x
            assert x.programs_per_sm() >= 1, x
print("ok")
"""


@pytest.mark.skipif(not HAS_TRITON, reason="compiling needs Triton")
def test_fused_moe_kernel_compiles_for_gpus_and_fits(tmp_path: os.PathLike) -> None:
    """Every launch compiles to a cubin for sm_80 / sm_90 in fp16, bf16 and fp32, fits one SM,
    and does not spill: in a child without the interpreter (which never runs the compiler)."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
