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
from typing import Any

if "triton" not in sys.modules:  # still in time: see tests/test_kernels.py
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernels.fused_moe import fused_moe_kernel_torch, invoke_fused_moe_triton_kernel
from kernels.triton_utils import HAS_TRITON, interpreter_active
from tracevllm import _custom_ops as ops
from tracevllm.model_executor.layers.fused_moe.fused_moe import fused_experts
from tracevllm.model_executor.layers.fused_moe.layer import FusedMoE
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

# (num_tokens, num_experts, top_k, hidden, intermediate): block sizes 16, 32 and 64
# (get_default_config), K and N not multiples of the tiles, several blocks per expert.
KERNEL_CASES = {
    "decode": (3, 8, 2, 64, 32),
    "small_batch": (20, 6, 2, 48, 40),
    "several_blocks_per_expert": (40, 4, 3, 72, 24),
    "top1": (9, 5, 1, 16, 16),
    # top 1 with the busy expert: every token on one expert, all the others idle.
    "every_token_on_one_expert": (40, 4, 1, 40, 24),
    # ... with enough tokens per expert (M // E > 128) for GROUP_SIZE_M = 16: programs
    # walk the expert's 5 row blocks down one column of tiles, then the next (N > BLOCK_N).
    "every_token_on_one_expert_grouped": (264, 2, 1, 160, 80),
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
    logit set below the others so no token picks it, one above so every token does."""
    gen = torch.Generator().manual_seed(10 + seed)
    rand = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))
    num_tokens, num_experts = rand(1, 40), rand(3, 8)
    top_k, hidden, intermediate = rand(1, min(3, num_experts - 1)), 16 * rand(1, 4), 8 * rand(1, 6)
    x = torch.randn(num_tokens, hidden, generator=gen)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    # Expert 0 below every other, the last above: the router's weights stay far from 0 and 1.
    logits[:, 0] = logits.min(dim=1).values - 0.5
    logits[:, -1] = logits.max(dim=1).values + 0.5
    w13, w2 = _weights(num_experts, hidden, intermediate, gen)
    topk_weights, topk_ids, _ = fused_topk(x, logits, top_k, renormalize=True)
    counts = torch.bincount(topk_ids.flatten(), minlength=num_experts)
    assert counts[0] == 0 and counts[-1] == num_tokens
    expected = fused_experts(x, w13, w2, topk_weights, topk_ids, backend="torch")
    out = fused_experts(
        *(t.to(DEVICE) for t in (x, w13, w2, topk_weights, topk_ids)), backend="triton"
    )
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=live)])
def test_fused_experts_with_no_tokens(backend: str) -> None:
    """An empty batch (a rank with nothing to do) gives an empty output, no launch error."""
    w13, w2 = _weights(4, 16, 8, torch.Generator().manual_seed(0))
    args = (torch.zeros(0, 16), w13, w2, torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.int32))
    out = fused_experts(*(t.to(DEVICE) for t in args), backend=backend)
    assert out.shape == (0, 16)


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


# --- the layer ------------------------------------------------------------------------------


def make_checkpoint(
    num_experts: int, hidden: int, intermediate: int, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """One expert MLP per id, named as a Qwen3-MoE / Mixtral-style HF checkpoint names them."""
    checkpoint = {}
    for e in range(num_experts):
        checkpoint[f"experts.{e}.gate_proj.weight"] = torch.randn(
            intermediate, hidden, generator=gen
        )
        checkpoint[f"experts.{e}.up_proj.weight"] = torch.randn(intermediate, hidden, generator=gen)
        checkpoint[f"experts.{e}.down_proj.weight"] = torch.randn(
            hidden, intermediate, generator=gen
        )
    return {k: v / v.shape[1] ** 0.5 for k, v in checkpoint.items()}


def load_checkpoint(layer: FusedMoE, checkpoint: dict[str, torch.Tensor]) -> set[str]:
    """What a model's ``load_weights`` does with the layer's expert mapping."""
    mapping = FusedMoE.make_expert_params_mapping(
        layer, "gate_proj", "down_proj", "up_proj", layer.global_num_experts
    )
    params = {f"experts.{n}": p for n, p in layer.named_parameters()}
    loaded = set()
    for name, tensor in checkpoint.items():
        for param_name, weight_name, expert_id, shard_id in mapping:
            if weight_name not in name:
                continue
            name = name.replace(weight_name, param_name)  # experts.3.gate_proj. -> experts.w13_
            param = params[name]
            param.weight_loader(param, tensor, name, shard_id=shard_id, expert_id=expert_id)
            loaded.add(name)
            break
        else:
            raise AssertionError(f"no mapping for {name}")
    return loaded


def stacked(
    checkpoint: dict[str, torch.Tensor], num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The checkpoint as vLLM stacks it: w13 [E, 2I, H] (gate rows, then up), w2 [E, H, I]."""
    w13 = torch.stack(
        [
            torch.cat(
                [
                    checkpoint[f"experts.{e}.gate_proj.weight"],
                    checkpoint[f"experts.{e}.up_proj.weight"],
                ]
            )
            for e in range(num_experts)
        ]
    )
    w2 = torch.stack([checkpoint[f"experts.{e}.down_proj.weight"] for e in range(num_experts)])
    return w13, w2


def test_make_expert_params_mapping_names_vllms_way() -> None:
    mapping = FusedMoE.make_expert_params_mapping(nn.Module(), "w1", "w2", "w3", num_experts=2)
    assert mapping == [
        ("experts.w13_", "experts.0.w1.", 0, "w1"),
        ("experts.w2_", "experts.0.w2.", 0, "w2"),
        ("experts.w13_", "experts.0.w3.", 0, "w3"),
        ("experts.w13_", "experts.1.w1.", 1, "w1"),
        ("experts.w2_", "experts.1.w2.", 1, "w2"),
        ("experts.w13_", "experts.1.w3.", 1, "w3"),
    ]


def test_weight_loader_fills_each_expert_by_id() -> None:
    """Loaded in a shuffled order, each expert's gate, up and down land in its own slot."""
    gen = torch.Generator().manual_seed(5)
    num_experts, hidden, intermediate = 5, 12, 8
    layer = FusedMoE(num_experts, 2, hidden, intermediate, tp_size=1)
    layer.w13_weight.data.fill_(float("nan"))
    layer.w2_weight.data.fill_(float("nan"))
    checkpoint = make_checkpoint(num_experts, hidden, intermediate, gen)
    names = list(checkpoint)
    shuffled = {names[i]: checkpoint[names[i]] for i in torch.randperm(len(names), generator=gen)}
    assert load_checkpoint(layer, shuffled) == {"experts.w13_weight", "experts.w2_weight"}
    for e in range(num_experts):
        assert torch.equal(
            layer.w13_weight[e, :intermediate], checkpoint[f"experts.{e}.gate_proj.weight"]
        )
        assert torch.equal(
            layer.w13_weight[e, intermediate:], checkpoint[f"experts.{e}.up_proj.weight"]
        )
        assert torch.equal(layer.w2_weight[e], checkpoint[f"experts.{e}.down_proj.weight"])

    # A 3-D tensor fills every expert at once (vLLM's full load).
    w13, w2 = stacked(checkpoint, num_experts)
    other = FusedMoE(num_experts, 2, hidden, intermediate, tp_size=1)
    other.weight_loader(other.w13_weight, w13[:, :intermediate], "w13_weight", "w1", 0)
    other.weight_loader(other.w13_weight, w13[:, intermediate:], "w13_weight", "w3", 0)
    assert other.weight_loader(other.w2_weight, w2, "w2_weight", "w2", 0, return_success=True)
    assert torch.equal(other.w13_weight, layer.w13_weight) and torch.equal(other.w2_weight, w2)


@pytest.mark.parametrize(
    "args,match",
    [
        (("w13_weight", "w4", 0), "shard_id must be \\['w1','w2','w3'\\] but got w4"),
        (("w13_weight", "w1", 5), "expert_id 5 of 'w13_weight' is out of range: this layer has 5"),
        (("w13_weight", "w1", -1), "expert_id -1"),
        (("w13_weight", "w1", True), "expert_id must be an int"),
    ],
)
def test_weight_loader_refuses_bad_ids(args: tuple, match: str) -> None:
    layer = FusedMoE(5, 2, 12, 8, tp_size=1)
    with pytest.raises(ValueError, match=match):
        layer.weight_loader(layer.w13_weight, torch.zeros(8, 12), *args)


def test_weight_loader_refuses_wrong_shapes() -> None:
    """A transposed or truncated tensor is named, not broadcast into the slot."""
    layer = FusedMoE(5, 2, 12, 8, tp_size=1)
    with pytest.raises(
        ValueError, match="'gate.weight' has shape \\(8, 1\\) for a slot of shape \\(8, 12\\)"
    ):
        layer.weight_loader(layer.w13_weight, torch.zeros(8, 1), "gate.weight", "w1", 0)
    with pytest.raises(ValueError, match="'down.weight' has 12 along its intermediate dimension"):
        layer.weight_loader(layer.w2_weight, torch.zeros(8, 12), "down.weight", "w2", 0)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"num_experts": 0}, "num_experts must be a positive int, got 0"),
        ({"top_k": True}, "top_k must be a positive int, got True"),
        ({"top_k": 9}, "top_k \\(9\\) must not exceed num_experts \\(8\\)"),
        ({"hidden_size": 2.0}, "hidden_size must be a positive int"),
        ({"intermediate_size": 6, "tp_size": 4}, "intermediate_size \\(6\\) is not divisible by"),
        ({"scoring_func": "softplus"}, "Unsupported scoring function: softplus"),
        ({"activation": "gelu"}, "Unsupported FusedMoe activation: gelu"),
        ({"quant_config": object()}, "quant_config must be None"),
    ],
)
def test_fused_moe_refuses_bad_arguments(kwargs: dict, match: str) -> None:
    args = {"num_experts": 8, "top_k": 2, "hidden_size": 16, "intermediate_size": 8, "tp_size": 1}
    with pytest.raises(ValueError, match=match):
        FusedMoE(**{**args, **kwargs})


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=live)])
def test_fused_moe_layer_matches_a_dense_per_token_loop(backend: str) -> None:
    """Loaded by expert id, routed and run: the loop over tokens and experts, on a routing with
    an expert no token picks and one every token picks."""
    gen = torch.Generator().manual_seed(7)
    num_tokens, num_experts, top_k, hidden, intermediate = 21, 6, 2, 32, 16
    layer = FusedMoE(
        num_experts, top_k, hidden, intermediate, tp_size=1, prefix="model.layers.1.mlp.experts"
    )
    checkpoint = make_checkpoint(num_experts, hidden, intermediate, gen)
    load_checkpoint(layer, checkpoint)
    layer.moe_backend = backend
    x = torch.randn(num_tokens, hidden, generator=gen)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    logits[:, 2] = logits.min(dim=1).values - 0.5  # never picked
    logits[:, 4] = logits.max(dim=1).values + 0.5  # always picked, not by a landslide
    counts = torch.bincount(layer.select_experts(x, logits)[1].flatten(), minlength=num_experts)
    assert counts[2] == 0 and counts[4] == num_tokens
    out = layer.to(DEVICE)(x.to(DEVICE), logits.to(DEVICE)).cpu()
    expected = dense_moe(x, logits, *stacked(checkpoint, num_experts), top_k, renormalize=True)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_fused_moe_forward_span_counts_tokens_per_expert() -> None:
    """At detail "full" one FusedMoE.forward span per call, with each expert's token count;
    at "request" none."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tracevllm import tracing
    from tracevllm.config import TraceConfig

    gen = torch.Generator().manual_seed(8)
    layer = FusedMoE(4, 2, 16, 8, tp_size=1, prefix="model.layers.3.mlp.experts")
    load_checkpoint(layer, make_checkpoint(4, 16, 8, gen))
    x = torch.randn(5, 16, generator=gen)
    # Experts 3 and 1 for three tokens, 0 and 1 for two: counts [2, 5, 0, 3].
    logits = torch.tensor([[0, 5, -9, 9]] * 3 + [[9, 5, -9, 0]] * 2, dtype=torch.float32)
    try:
        for detail in ("request", "full"):
            exporter = InMemorySpanExporter()  # a shut-down exporter takes no more spans
            tracing.init_tracer(
                "engine_core",
                TraceConfig(detail=detail),
                span_processors=[SimpleSpanProcessor(exporter)],
            )
            with tracing.forward_spans():
                out = layer(x, logits)
            tracing.shutdown_tracer()
            spans = [s for s in exporter.get_finished_spans() if s.name == "FusedMoE.forward"]
            assert len(spans) == (detail == "full")
    finally:
        tracing.shutdown_tracer()
    attributes = spans[0].attributes
    assert list(attributes["tracevllm.moe.tokens_per_expert"]) == [2, 5, 0, 3]
    assert attributes["tracevllm.layer"] == 3 and attributes["tracevllm.moe.top_k"] == 2
    assert attributes["code.function.name"] == "FusedMoE.forward"
    torch.testing.assert_close(out, layer.forward_impl(x, logits))


def _tp_rank_main(rank: int, port: int, reduce_results: bool, queue: Any) -> None:
    """One of two TP ranks: load the whole checkpoint, keep its half of the intermediate dim."""
    from tracevllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    init_distributed_environment(2, rank, f"tcp://127.0.0.1:{port}", backend="gloo")
    initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        gen = torch.Generator().manual_seed(9)
        checkpoint = make_checkpoint(6, 16, 12, gen)
        x, logits = torch.randn(7, 16, generator=gen), torch.randn(7, 6, generator=gen)
        layer = FusedMoE(6, 2, 16, 12, reduce_results=reduce_results)  # TP size from the group
        load_checkpoint(layer, checkpoint)
        # As numpy arrays, pickled by value: torch would hand over shared-memory
        # handles, which vanish when this process exits before the parent reads them.
        tensors = (layer.w13_weight, layer.w2_weight, layer(x, logits))
        queue.put((rank, layer.tp_size, *(t.detach().numpy().copy() for t in tensors)))
    finally:
        destroy_model_parallel()
        destroy_distributed_environment()


@pytest.mark.parametrize("reduce_results", [True, False])
def test_fused_moe_tensor_parallel_over_two_processes(reduce_results: bool) -> None:
    """Two real ranks (gloo): each holds every expert's slice of the intermediate dimension
    (gate and up rows, down columns) and, all-reduced, gives the one-process output; without
    ``reduce_results`` the two partial outputs sum to it."""
    import multiprocessing
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_tp_rank_main, args=(r, port, reduce_results, queue)) for r in (0, 1)
    ]
    for p in procs:
        p.start()
    try:
        results = sorted(queue.get(timeout=180) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]

    gen = torch.Generator().manual_seed(9)
    checkpoint = make_checkpoint(6, 16, 12, gen)
    x, logits = torch.randn(7, 16, generator=gen), torch.randn(7, 6, generator=gen)
    w13, w2 = stacked(checkpoint, 6)
    whole = FusedMoE(6, 2, 16, 12, tp_size=1)
    load_checkpoint(whole, checkpoint)
    expected = whole(x, logits)
    for rank, tp_size, *arrays in results:
        assert tp_size == 2
        rank_w13, rank_w2, _ = (torch.from_numpy(a) for a in arrays)
        half = slice(6 * rank, 6 * rank + 6)
        assert torch.equal(rank_w13[:, :6], w13[:, :12][:, half])  # gate rows
        assert torch.equal(rank_w13[:, 6:], w13[:, 12:][:, half])  # up rows
        assert torch.equal(rank_w2, w2[:, :, half])  # down columns
    outs = [torch.from_numpy(r[4]) for r in results]
    if reduce_results:
        for out in outs:
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    else:
        assert not torch.allclose(outs[0], expected, atol=1e-3)
        torch.testing.assert_close(outs[0] + outs[1], expected, atol=1e-5, rtol=1e-5)
